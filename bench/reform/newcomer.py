"""Case 3, the driver's side: the group shrinks from three ranks to two, and a newcomer joins.

Why: a path must also take a process that was never in the group. Round 0 has three ranks;
on the notice ``go1`` rank 2 leaves and the two survivors re-form (round 1); on ``go2`` the
survivors re-form again, joined by a newcomer (``worker.newcomer``) started ahead and waiting
for that notice. The newcomer dials once the round's store listens, as a script that imports
torch first would; fresh's is also run dialling at once (``early``), to show what torch's
refused client costs. Times are from the notice to the first collective of the round.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.reform.harness import FIRST_S, Run

JOINED = ("r0", "r1", "new")  # the ranks of round 2


def case_join(run: Run, a: argparse.Namespace, out: dict[str, Any]) -> None:
    for path, early in (("fresh", False), ("fresh", True), ("reconf", False)):
        reps = [join_rep(run, path, early, rep) for rep in range(a.reps)]
        out.setdefault("join", []).append({"path": path, "early": early, "reps": reps})


def join_rep(run: Run, path: str, early: bool, rep: int) -> dict[str, Any]:
    L = run.launch(f"join-{path}{'-early' if early else ''}-{rep}")
    ports = run.ports(3)
    for r in range(3):
        L.start(f"r{r}", case="join", path=path, rank=r, ports=ports)
    L.start("new", case="join", path=path, rank=2, ports=ports, early=early)
    res: dict[str, Any] = {}
    ok = L.wait(lambda: all(L.first(f"r{r}", "training") for r in range(3)), FIRST_S)
    if ok:
        time.sleep(0.3)
        t1 = L.notice("go1")
        ok = L.wait(
            lambda: all(
                len([e for e in L.events(w) if e["ev"] == "training"]) == 2 for w in ("r0", "r1")
            ),
            20,
        )
        res["shrink_s"] = [f["t"] - t1 for w in ("r0", "r1") if (f := L.first(w, "formed", k=1))]
    if ok:
        time.sleep(0.3)
        t2 = L.notice("go2")
        ok = L.wait(lambda: all(L.first(w, "ok") or L.ended(w) for w in JOINED), 30)
        res["join_s"] = {w: f["t"] - t2 for w in JOINED if (f := L.first(w, "formed", k=2))}
        res["parts"] = {w: f["parts"] for w in JOINED if (f := L.first(w, "formed", k=2))}
        res["joined"] = all(L.first(w, "ok") for w in JOINED)
    if not res.get("joined"):
        res["joined"] = False
        res["why"] = (
            "; ".join(
                f"{w}: {c['type']}: {c['msg']}" for w in L.procs if (c := L.first(w, "crash"))
            )
            or "timed out"
        )
    L.stop(dump=not res.get("joined"))
    print(f"[3] {path}{' early' if early else ''}: {json.dumps(res)}", flush=True)
    return res
