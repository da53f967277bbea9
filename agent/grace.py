"""How long workers get between SIGTERM and SIGKILL, by why they stop.

Why two graces: a stop between rounds — a membership change (a node died, joined or left), a
superseded round, a restart after a worker failed — ends a world that is already broken: its
collectives cannot complete, and a worker blocked in one never answers SIGTERM. Giving it the
job-end grace (``--stop-grace``/``--shutdown-timeout``, 30 s as torchrun) held every survivor
still for that long: with SIGTERM-deaf workers, 3 agents and one kill -9, the survivors ran
again only after 32 s. So between rounds the workers get ``--restart-grace`` (SIGTERM first,
so a worker can still flush a line or a log, then SIGKILL), and only the end of the job — the
user's signal, a finished job — keeps the long grace, for checkpoints. A lost lease gets none
(fencing, S4).

Why 3 s: a worker that does answer SIGTERM is gone in well under a second (measured here, 5
runs each: a handler that writes a file and re-raises, 0.004-0.011 s; a process that imported
torch 2.13, 0.019-0.032 s), so 3 s leaves a wide margin for a flush under load, while the
recovery stays a few seconds: kill -9 of one of 3 agents with SIGTERM-deaf workers, lease_ttl 2,
survivors running again 5.04-5.20 s after the kill (4 runs) with the 3 s default, against
32.2 s with the 30 s stop grace before (tests/rendezvous/test_fault_stops.py prints it).
"""

from __future__ import annotations

DEFAULT_RESTART_GRACE = 3.0


def stop_grace(grace: float | None, restart: bool, stop: float, between: float | None) -> float:
    """The grace of one stop: ``grace`` when the loop fixed it (0: fencing), else
    ``between`` rounds (``restart``; None: the default) or ``stop`` (the job's end)."""
    if grace is not None:
        return grace
    if restart:
        return DEFAULT_RESTART_GRACE if between is None else between
    return stop


__all__ = ["DEFAULT_RESTART_GRACE", "stop_grace"]
