"""State: what a worker keeps through a membership change, and how it is shared.

Why commit and restore: a round change interrupts a step at any point (inside a collective, in
the optimizer's update), so the only state known to be the same on every rank is the one all of
them committed last. ``restore()`` goes back to it; the step in flight is computed again, and
no other.

Why each value by its handler: modules, optimizers, LR schedulers, samplers and random
generators are objects the script keeps using; each is saved by its ``state_dict`` and loaded
in place, so a scheduler stays bound to the live optimizer (handlers.py). A commit copies what
the handlers hand out into host buffers it keeps (snapshot.py): no deep copy per step.

Why ``sync()`` picks the newest commit: a newcomer starts with nothing committed, a survivor
with every commit so far; each rank counts its commits, and every rank takes the state of the
rank with the highest count (the lowest rank among equals), streamed over the new group tensor
by tensor (stream.py). The newcomer thus starts from a survivor's memory, not from a
checkpoint. Then every rank checks that its live state is the source's (agree.py). A receiver
takes the stream into its commit's own buffers (no second copy of the state), so a sync that
breaks halfway leaves them part its, part the source's; it takes them again from its live
objects, which hold its last commit then (restored before the re-form, or never moved from a
newcomer's start), and a later round could otherwise spread that mix as a commit.

Why ``commit()`` also beats: it is the natural progress signal of the agent's hang watchdog
(``--hang-timeout``, elastic/progress.py), at no cost when the watchdog is off.

Why ``commit()`` also checks the round: a rank that is computing, not communicating, learns that
the round is over at its next safe point — ``commit()`` raises ``MembershipChanged`` there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from etcdrun.elastic import agree, interrupt, stream
from etcdrun.elastic.group import device
from etcdrun.elastic.handlers import Handler, handler_for
from etcdrun.elastic.inflight import InFlight
from etcdrun.elastic.progress import progress
from etcdrun.elastic.snapshot import Saved, Snapshot


class State:
    """``State(**values)``: each value an attribute, kept by the handler its type has
    (handlers.py): modules, optimizers, LR schedulers, anything with ``state_dict`` and
    ``load_state_dict``, ``RandomState``, types given to ``register_handler``, and plain values
    (numbers, strings, tensors, and lists, tuples and dicts of them). The keyword is the
    script's choice: ``State(net=model, opt=opt, sched=sched, step=0)``.
    """

    def __init__(self, **values: Any) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self._serial = 0  # commits so far: sync() takes the state of the highest
        self._inflight: InFlight | None = None  # borrowed: see attach()
        for name in values:
            if name.startswith("_") or hasattr(type(self), name):
                raise ValueError(f"State: {name!r} is a name of the State itself; choose another")
        for name, value in values.items():
            handler_for(value)  # refused here, with the remedy, rather than at the first commit
            setattr(self, name, value)
        self._names = tuple(values)
        self._shared_copy, self._own_copy = Snapshot(), Snapshot()
        self._shared, self._own = self._take()

    # ---- the contract -------------------------------------------------------------------------
    def commit(self) -> None:
        """A safe point: keep the state as it is now; raise ``MembershipChanged`` when the
        round this worker runs in is over (``elastic.run`` then re-forms and calls again).

        On NCCL the round is checked first: a release aborts the communicators, and a step
        whose collectives it cut short may finish on the host without an error and with a
        partial sum on the device, so a step during which the round ended is not committed
        (it is computed again). On gloo a step that got here had every collective complete.
        """
        if _on_device():
            import torch

            torch.cuda.synchronize()
            interrupt.check()
        self._shared, self._own = self._take()
        self._serial += 1
        progress(self._step())
        interrupt.check()

    @property
    def commits(self) -> int:
        """How many commits the state holds; after ``sync()``, those of the newest rank."""
        return self._serial

    @property
    def committed_bytes(self) -> int:
        """The bytes of tensors a commit copies (what ``sync()`` sends, per-rank values aside)."""
        return self._shared.nbytes + self._own.nbytes

    def restore(self) -> None:
        """Back to the last commit."""
        self._load(self._shared)
        self._load(self._own)

    def sync(self) -> int:
        """Every rank takes the committed state of the rank with the newest commit, then checks
        that its live state is that rank's (``ReplicasDiverged`` otherwise); returns the bytes
        sent (0 in a world of one or outside a process group). Values kept per rank stay each
        rank's own. Each collective is started asynchronously and waited on through the
        borrowed ``InFlight`` (``attach``), so that a release ends the wait.
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return 0
        on = device()
        me = torch.tensor([self._serial, -dist.get_rank()], dtype=torch.int64, device=on)
        every = [torch.zeros_like(me) for _ in range(dist.get_world_size())]
        self._wait(dist.all_gather(every, me, async_op=True))
        serial, neg_rank = max(tuple(int(x) for x in t.tolist()) for t in every)
        src = -neg_rank
        mine = dist.get_rank() == src
        try:
            saved, sent = stream.broadcast(
                self._shared if mine else None, src, self._wait, on, self._shared_copy.reusable()
            )
        except BaseException:
            if not mine:  # its buffers may hold part of the source's state now: take them again
                self._shared = self._shared_copy.take(self._live(True))
            raise
        self._shared_copy.adopt(saved)
        self._shared, self._serial = saved, serial
        # The source loads its own commit too: its live state may no longer be it. A re-form
        # rebuilds DDP, whose constructor broadcasts rank 0's live parameters, and rank 0 may be
        # a newcomer or a survivor with an older commit (the in-place soak's seed 13241).
        self._load(saved)
        synced = {name: saved.part(name, clone=False, place=False) for name in saved.skeleton}
        agree.check(self._live(shared=True), synced, src, self._wait, on)
        return sent

    def on_reset(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every re-form, once the state is synced (rebuild the data
        loader for the new world, rescale the learning rate, ...).
        """
        self._callbacks.append(callback)

    def reset(self) -> None:
        """Run the reset callbacks (``elastic.run`` calls it after each re-form)."""
        for callback in self._callbacks:
            callback()

    def rewrap(self) -> None:
        """After a re-form: a DDP model among the values becomes, in place, the one a
        newcomer's script builds now (see ``ddp.rewrap``).
        """
        from etcdrun.elastic import ddp

        for value in self._values().values():
            ddp.rewrap(value)

    def attach(self, inflight: InFlight) -> None:
        """Borrow ``inflight`` (the worker's group's, elastic.run hands it after each form), so
        that a release ends the collectives the state waits on: ``sync()``'s, and its DDP
        models' all-reduces.
        """
        from etcdrun.elastic import ddp

        self._inflight = inflight
        for value in self._values().values():
            ddp.attach(value, inflight)

    # ---- how ------------------------------------------------------------------------------------
    def _values(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in self._names}

    def _handlers(self) -> dict[str, Handler | None]:
        return {n: handler_for(v) for n, v in self._values().items()}

    def _live(self, shared: bool) -> dict[str, Any]:
        """Each value's tree as its handler hands it out now (live tensors), shared or own."""
        trees = {}
        for name, handler in self._handlers().items():
            value = getattr(self, name)
            if (handler is not None and handler.kept_per_rank(value)) is shared:
                continue
            trees[name] = handler.save(value) if handler is not None else value
        return trees

    def _take(self) -> tuple[Saved, Saved]:
        return self._shared_copy.take(self._live(True)), self._own_copy.take(self._live(False))

    def _load(self, saved: Saved) -> None:
        """Put ``saved`` back into the live values: objects in place (modules, then optimizers,
        then the rest, so that a scheduler's state lands on a loaded optimizer), plain values
        as copies.
        """
        handlers = self._handlers()
        names = [n for n in saved.skeleton if n in handlers]
        names.sort(key=lambda n: handlers[n].order if handlers[n] is not None else 99)
        for name in names:
            handler = handlers[name]
            if handler is None:
                setattr(self, name, saved.part(name, clone=True))
            else:
                handler.load(getattr(self, name), saved.part(name, clone=not handler.copies))

    def _step(self) -> int | None:
        """The state's ``step``, when it holds an integer one: the hang line names it."""
        step = vars(self).get("step") if "step" in self._names else None
        return step if isinstance(step, int) else None

    def _wait(self, work: Any) -> None:
        if self._inflight is not None:
            self._inflight.wait(work)
        else:
            work.wait()


class TorchState(State):
    """``TorchState(model=, optimizer=, **values)``: the usual names for a ``State`` (any
    keyword works as well, and a scheduler, a sampler or a ``RandomState`` needs nothing
    more). A ``DistributedDataParallel`` model is rebuilt on each new group in place
    (``rewrap``), so the script's own reference to it stays valid.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **values: Any) -> None:
        super().__init__(model=model, optimizer=optimizer, **values)


def _on_device() -> bool:
    """Whether the default group is NCCL's (see ``commit``)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"


__all__ = ["State", "TorchState"]
