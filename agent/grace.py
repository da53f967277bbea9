"""How long workers get between SIGTERM and SIGKILL, by why they stop.

Why two graces: a stop between rounds — a membership change (a node died, joined or left), a
superseded round, a restart after a worker failed — ends a world that is already broken: its
collectives cannot complete, and a worker blocked in one never answers SIGTERM. Giving it the
job-end grace (``--stop-grace``/``--shutdown-timeout``, 30 s as torchrun) held every survivor
still for that long: with SIGTERM-deaf workers, one kill -9 cost the survivors the whole grace
before they ran again. So between rounds the workers get ``--restart-grace`` (SIGTERM first,
so a worker can still flush a line or a log, then SIGKILL), and only the end of the job — the
user's signal, a finished job — keeps the long grace, for checkpoints. A lost lease gets none
(fencing, S4).

Why 3 s: a worker that does answer SIGTERM is gone in well under a second, even one that imported
torch, so 3 s leaves a wide margin for a flush under load, while a recovery with SIGTERM-deaf
workers stays a few seconds instead of the job-end grace (tests/rendezvous/etcd/test_fault_stops.py
prints it; the figures: bench/results/figures.md).
"""

from __future__ import annotations

DEFAULT_RESTART_GRACE = 3.0


def stop_grace(grace: float | None, restart: bool, stop: float, between: float | None) -> float:
    """The grace of one stop: ``grace`` when the loop fixed it (0: fencing), else
    ``between`` rounds (``restart``; None: the default) or ``stop`` (the job's end).
    """
    if grace is not None:
        return grace
    if restart:
        return DEFAULT_RESTART_GRACE if between is None else between
    return stop


__all__ = ["DEFAULT_RESTART_GRACE", "stop_grace"]
