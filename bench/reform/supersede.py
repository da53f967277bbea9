"""Case 5, the driver's side: a round superseded while it forms.

Why: in etcdrun a round can end before every rank reached its form (a member leaves meanwhile);
a path must let the ranks that began forming it get out and meet in the next round, whoever
was told early, the store's host included. All ``--supersede`` superseded rounds run in one
launch per path (``worker.case_supersede``): the driver only watches for a rank silent too long,
then reads from the logs whether every rank reached round k+1, how long after round k's
release, and how the superseded forms ended.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.reform.harness import FIRST_S, HANG_S, PATHS, Launch, Run

RANKS = ["r0", "r1", "r2"]


def case_supersede(run: Run, a: argparse.Namespace, out: dict[str, Any]) -> None:
    for path in PATHS:
        L = run.launch(f"supersede-{path}")
        ports = run.ports(1 + 2 * a.supersede)
        for r in range(3):
            L.start(
                RANKS[r],
                case="supersede",
                path=path,
                rank=r,
                seed=a.first,
                reps=a.supersede,
                ports=ports,
            )
        L.stop(dump=stuck(L))
        reps = superseded(L, a.supersede)
        print(f"[5] {path}: {json.dumps(reps)}", flush=True)
        out.setdefault("supersede", []).append({"path": path, "reps": reps, "n": a.supersede})


def stuck(L: Launch) -> bool:
    """Whether a rank went silent (FIRST_S before its first form, else HANG_S + 5 s) before
    every rank ended.
    """
    while not all(L.ended(w) for w in RANKS):
        time.sleep(0.1)
        now = time.monotonic()
        for w in RANKS:
            last = [e for e in L.events(w) if e["ev"] != "start"]
            limit = FIRST_S if not last else HANG_S + 5
            if not L.ended(w) and now - (last[-1]["t"] if last else L.began) > limit:
                return True
    return False


def superseded(L: Launch, n: int) -> list[dict[str, Any]]:
    """Each superseded round, as the logs tell it, up to the first one not got past."""
    evs = {w: L.events(w) for w in RANKS}
    reps = []
    for i in range(n):
        k, skip = 1 + 2 * i, RANKS[i % 3]
        f = {w: e["t"] for w in RANKS for e in evs[w] if e["ev"] == "formed" and e["k"] == k + 1}
        r = {w: e["t"] for w in RANKS for e in evs[w] if e["ev"] == "rel" and e["k"] == k}
        how = sorted(
            {
                f"{e['type']}"
                for w in RANKS
                for e in evs[w]
                if e["ev"] == "form_ended" and e["k"] == k
            }
        )
        rep: dict[str, Any] = {"skip": skip, "reached": len(f) == 3, "how": how}
        if len(f) == 3 and r:
            rep["time_s"] = max(f.values()) - min(r.values())
        if len(f) < 3:
            rep["where"] = {w: L.where(w) for w in RANKS if w not in f}
        reps.append(rep)
        if len(f) < 3:
            break
    return reps
