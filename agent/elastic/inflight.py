"""InFlight: DDP's gradient all-reduces, as futures that a release ends (design.md §4a).

Why: shutting the group's sockets (group.py) fails every collective that waits on gloo's
connections, save one case. gloo queues a send whose write failed (the socket was shut a moment
before, or the peer's reset came first) to retry it later. When the connection then fails,
gloo errors every operation it keeps pending, but not the sends in that queue. The collective's
thread then waits on that send until the group's timeout (30 minutes), and DDP's backward waits
on the collective. A release during training met that window about once in a hundred rounds
(bench/results/release_stress.md), and the worker held its round and every peer with it.

So etcdrun gives DDP a communication hook that does what DDP does without one: divide the
bucket by the world size, then sum it over the group. What DDP waits on is a future of ours,
which gloo's result completes. ``end()`` fails every future of ours still pending, so DDP's
backward raises in the main thread at the release whatever gloo does. A gloo collective that
is still running after the release keeps its thread until gloo's timeout. ``running()`` names
such collectives, so that the caller keeps their group alive: destroying it would join that
thread.

Limits: a model with a communication hook of the script's own, DDP's mixed precision, or a
group other than the default one keeps DDP's own all-reduce. So does NCCL, whose abort fails
every pending work. A synchronous collective (``dist.all_reduce`` and the like) waits on gloo's
work itself, which nothing outside gloo can end: the same defect can hold it until the timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

FAILED = "etcdrun: the group's collective failed"  # runner.py takes it for the transport's


class CollectiveEnded(RuntimeError):
    """A collective of a released group, or one that gloo failed (its error in the message)."""


class InFlight:
    """One per worker: ``hook(model)`` on each DDP model of a group, ``end()`` at its release,
    ``restart()`` before the next group. Thread-safe: DDP calls the hook on autograd's thread,
    gloo completes its futures on its own, and the release comes from the agent's link.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ours: list[Any] = []  # futures DDP waits on, not yet complete
        self._theirs: list[Any] = []  # gloo's futures behind them
        self._ended = False

    def hook(self, model: Any) -> bool:
        """Route ``model``'s all-reduces through this object; False when it keeps DDP's own
        (see the module docstring for when).
        """
        import torch.distributed as dist

        if model._comm_hooks or model.mixed_precision is not None:
            return False
        if model.process_group is not dist.group.WORLD or dist.get_backend() != "gloo":
            return False
        try:
            model.register_comm_hook(self, _allreduce)
        except RuntimeError:  # a built-in hook of the script's: DDP takes one hook only
            model._comm_hooks.pop()
            return False
        return True

    def wait(self, work: Any) -> None:
        """Wait for a collective started with ``async_op=True``, or until the release: what
        ``elastic.run``'s own collectives (the round check, the state's sync) wait on. Then the
        work's own ``wait()``: NCCL's future completes once the collective is queued, and only
        that call makes the current CUDA stream wait for its result (gloo's returns at once).
        """
        self._track(work.get_future(), lambda value: None).wait()
        work.wait()

    def end(self) -> None:
        """Fail every collective still waited on through this object (the group was
        released): DDP's all-reduces and ``wait()``'s.
        """
        with self._lock:
            self._ended = True
            pending, self._ours = self._ours, []
            for ours in pending:
                if not ours.done():
                    ours.set_exception(CollectiveEnded(f"{FAILED}: the round ended"))

    def running(self) -> list[Any]:
        """gloo's collectives that have not ended yet."""
        with self._lock:
            self._theirs = [f for f in self._theirs if not f.done()]
            return list(self._theirs)

    def restart(self) -> None:
        """A new group: its all-reduces are waited on again."""
        with self._lock:
            self._ours, self._theirs, self._ended = [], [], False

    def _track(self, theirs: Any, result: Callable[[Any], Any]) -> Any:
        """A future of ours that ``theirs`` completes with ``result(its value)``, or its error;
        or ``end()`` fails first.
        """
        import torch

        ours: torch.futures.Future[Any] = torch.futures.Future()

        def done(fut: Any) -> None:
            with self._lock:
                if ours.done():
                    return  # ended by a release
                try:
                    ours.set_result(result(fut.value()))
                except Exception as e:  # noqa: BLE001 - gloo's error, passed on as ours
                    ours.set_exception(CollectiveEnded(f"{FAILED}: {e}"))

        with self._lock:
            if self._ended:
                ours.set_exception(CollectiveEnded(f"{FAILED}: the round ended"))
            else:
                self._ours = [f for f in self._ours if not f.done()] + [ours]
            self._theirs = [f for f in self._theirs if not f.done()] + [theirs]
        theirs.add_done_callback(done)
        return ours


def _allreduce(inflight, bucket):  # type: ignore[no-untyped-def]
    """DDP's own all-reduce (the mean over the default group), waited on through ``inflight``.
    Unannotated: DDP rejects a hook whose annotations are not its own types, and this module's
    annotations are strings.
    """
    import torch.distributed as dist

    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    work = dist.all_reduce(tensor, async_op=True)
    return inflight._track(work.get_future(), lambda value: value[0])


__all__ = ["FAILED", "CollectiveEnded", "InFlight"]
