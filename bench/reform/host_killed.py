"""Case 2, the driver's side: the first store's host is SIGKILLed, and the two survivors re-form.

Why this case: a reconfigure group keeps the store it was given at init for every later
``_reconfigure``, and round 0's rank 0 serves that store; the case tells whether a path
survives its host's death. Three paths: fresh, ``reconf-plain`` (init on round 0's TCPStore
itself) and ``reconf`` (init on the worker's swappable store). The driver waits until the three
train, kills rank 0, and writes the notice ``dead``; the survivors (``worker.case_kill0``)
release and re-form as ranks 0 and 1 of round 1. Per survivor: the re-form's time from the
notice and its parts, or the error its re-form raised (with the part of the form it arose in),
or, silent, where it hung.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.reform.harness import FIRST_S, Launch, Run

SURVIVORS = ("r1", "r2")


def case_kill0(run: Run, a: argparse.Namespace, out: dict[str, Any]) -> None:
    for path in ("fresh", "reconf-plain", "reconf"):
        reps = []
        for rep in range(a.reps):
            reps.append(kill0_rep(run, path, rep))
        out.setdefault("kill0", []).append({"path": path, "reps": reps})


def kill0_rep(run: Run, path: str, rep: int) -> dict[str, Any]:
    L = run.launch(f"kill0-{path}-{rep}")
    ports = run.ports(2)
    ws = ["r0", "r1", "r2"]
    for r in range(3):
        L.start(ws[r], case="kill0", path=path, rank=r, ports=ports)
    res: dict[str, Any] = {"survivors": {}}
    if not L.wait(lambda: all(L.first(w, "training") for w in ws), FIRST_S):
        res["setup"] = "round 0 never formed"
        L.stop(dump=True)
        return res
    time.sleep(0.3)
    L.procs["r0"].kill()
    L.procs["r0"].join(5)
    t_dead = L.notice("dead")
    done = L.wait(
        lambda: all(L.first(w, "ok") or L.first(w, "error") or L.ended(w) for w in SURVIVORS),
        25.0,
    )
    L.stop(dump=not done)
    for w in SURVIVORS:
        res["survivors"][w] = survivor(L, w, t_dead)
    print(f"[2] {path}: {json.dumps(res)}", flush=True)
    return res


def survivor(L: Launch, w: str, t_dead: float) -> dict[str, Any]:
    """One survivor's re-form: its time and parts, or its error, or where it hung."""
    ok, err, f = L.first(w, "ok"), L.first(w, "error"), L.first(w, "formed", k=1)
    s: dict[str, Any] = {"ok": bool(ok)}
    if f:
        s["reform_s"] = f["t"] - t_dead
        s["parts"] = f["parts"]
    if err:
        s["error"] = f"{err['type']}: {err['msg']}"
        if err.get("stage"):
            s["error"] = f"in {err['stage']}: {s['error']}"
        s["error_after_s"] = err["after_s"]
    if not ok and not err:
        s["error"] = "hung: " + L.where(w)
    return s
