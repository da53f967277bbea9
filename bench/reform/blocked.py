"""Case 4, the driver's side: a synchronous all_reduce blocked on a SIGSTOPped peer.

Why: a script's own ``dist.all_reduce`` returns no future for InFlight to end; only the release
of the group's sockets can free it, and ``reconf-alone`` (``_reconfigure`` to the two live
ranks, no shut) tells whether torch's reconfigure does it by itself. The driver SIGSTOPs rank 2
once round 0 has formed, waits until the kernel shows it stopped, and writes the notice
``stopped``; ranks 0 and 1 (``worker.case_stop``) block in an all_reduce, release 1 s later, and
re-form as two. A watchdog of ``--watch`` seconds in each rank reports a release that never came.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

from bench.reform.harness import Launch, Run

BLOCKED = ("r0", "r1")  # the ranks that block on the stopped rank 2


def case_stop(run: Run, a: argparse.Namespace, out: dict[str, Any]) -> None:
    for path in ("fresh", "reconf", "reconf-alone"):
        reps = [stop_rep(run, path, rep, a.watch) for rep in range(a.reps)]
        out.setdefault("stop", []).append({"path": path, "reps": reps})


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def stop_rep(run: Run, path: str, rep: int, watch: float) -> dict[str, Any]:
    L = run.launch(f"stop-{path}-{rep}")
    ports = run.ports(2)
    for r in range(3):
        L.start(f"r{r}", case="stop", path=path, rank=r, ports=ports, watch_s=watch)
    res: dict[str, Any] = {"ranks": {}}
    if not L.wait(lambda: all(L.first(f"r{r}", "formed", k=0) for r in range(3)), 40):
        res["setup"] = "round 0 never formed"
    else:
        pid = L.procs["r2"].pid
        os.kill(pid, signal.SIGSTOP)
        L.wait(lambda: _stopped(pid), 5)
        L.notice("stopped")
        L.wait(
            lambda: all(
                L.first(w, "ok") or L.first(w, "not_released") or L.ended(w) for w in BLOCKED
            ),
            watch + 20,
        )
        acts = [e["t"] for w in BLOCKED if (e := L.first(w, "act"))]
        for w in BLOCKED:
            res["ranks"][w] = blocked_rank(L, w, acts)
    L.stop()
    print(f"[4] {path}: {json.dumps(res)}", flush=True)
    return res


def blocked_rank(L: Launch, w: str, acts: list[float]) -> dict[str, Any]:
    """One blocked rank: released (after the first rank's release), how its release call
    returned, still blocked when its watchdog fired, re-formed as two (after its own release).
    """
    rel, act = L.first(w, "released"), L.first(w, "act")
    f, nr = L.first(w, "formed", k=1), L.first(w, "not_released")
    s: dict[str, Any] = {"released": bool(rel)}
    if rel and acts:
        s["after_s"] = rel["t"] - min(acts)
        s["error"] = rel["type"]
    if act:
        s["act_s"] = act["returned_s"]
        if "type" in act:
            s["act_error"] = f"{act['type']}: {act['msg']}"
    if nr:
        s["watched_s"] = nr["after_s"]
    if f:
        s["reform_s"] = f["since_act_s"]
        s["parts"] = f["parts"]
    s["ok"] = bool(L.first(w, "ok"))
    return s
