"""State and TorchState: what a worker keeps through a membership change, and how it is shared.

Why commit and restore: a round change interrupts a step at any point (inside a collective, in
the optimizer's update), so the only state known to be the same on every rank is the one all of
them committed last. ``restore()`` goes back to it; the step in flight is computed again, and
no other.

Why ``sync()`` picks the newest commit: a newcomer starts with nothing committed, a survivor
with every commit so far; each rank counts its commits, and every rank takes the state of the
rank with the highest count (the lowest rank among equals), broadcast over the new group. The
newcomer thus starts from a survivor's memory, not from a checkpoint.

Why ``commit()`` also beats: it is the natural progress signal of the agent's hang watchdog
(``--hang-timeout``, elastic/progress.py), at no cost when the watchdog is off.

Why ``commit()`` also checks the round: a rank that is computing, not communicating, learns that
the round is over at its next safe point — ``commit()`` raises ``MembershipChanged`` there.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

from etcdrun.elastic import interrupt
from etcdrun.elastic.inflight import InFlight
from etcdrun.elastic.progress import progress


class State:
    """Plain values as attributes (``State(step=0, epoch=0)``; any picklable values)."""

    def __init__(self, **values: Any) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self._serial = 0  # commits so far: sync() takes the state of the highest
        self._inflight: InFlight | None = None  # borrowed: see attach()
        for name, value in values.items():
            setattr(self, name, value)
        self._names = tuple(values)
        self._saved = self.save()

    # ---- what a subclass keeps ----------------------------------------------------------------
    def save(self) -> Any:
        """A copy of everything the state holds (a subclass adds its own)."""
        return {n: copy.deepcopy(getattr(self, n)) for n in self._names}

    def load(self, saved: Any) -> None:
        for n, value in saved.items():
            setattr(self, n, copy.deepcopy(value))

    # ---- the contract -------------------------------------------------------------------------
    def commit(self) -> None:
        """A safe point: keep the state as it is now; raise ``MembershipChanged`` when the
        round this worker runs in is over (``elastic.run`` then re-forms and calls again).
        """
        self._saved = self.save()
        self._serial += 1
        progress(self._step())
        interrupt.check()

    def _step(self) -> int | None:
        """The state's ``step``, when it holds an integer one: the hang line names it."""
        step = vars(self).get("step") if "step" in self._names else None
        return step if isinstance(step, int) else None

    @property
    def commits(self) -> int:
        """How many commits the state holds; after ``sync()``, those of the newest rank."""
        return self._serial

    def restore(self) -> None:
        """Back to the last commit."""
        self.load(self._saved)

    def sync(self) -> int:
        """Every rank takes the committed state of the rank with the newest commit; returns the
        bytes broadcast (0 in a world of one or outside a process group). Each collective is
        started asynchronously and waited on through the borrowed ``InFlight`` (``attach``),
        so that a release ends the wait even where gloo would not (``broadcast_object_list``
        waits on gloo itself).
        """
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return 0
        inflight, on = self._inflight, _device()
        wait = inflight.wait if inflight is not None else lambda work: work.wait()
        me = torch.tensor([self._serial, -dist.get_rank()], dtype=torch.int64, device=on)
        every = [torch.zeros_like(me) for _ in range(dist.get_world_size())]
        wait(dist.all_gather(every, me, async_op=True))
        serial, neg_rank = max(tuple(int(x) for x in t.tolist()) for t in every)
        src = -neg_rank
        if dist.get_rank() == src:
            blob = torch.frombuffer(bytearray(_dumps(self._saved)), dtype=torch.uint8).to(on)
            size = torch.tensor([blob.numel()], dtype=torch.int64, device=on)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=on)
        wait(dist.broadcast(size, src=src, async_op=True))
        if dist.get_rank() != src:
            blob = torch.empty(int(size.item()), dtype=torch.uint8, device=on)
        wait(dist.broadcast(blob, src=src, async_op=True))
        self._saved, self._serial = _loads(blob.cpu().numpy().tobytes()), serial
        self.restore()
        return int(size.item())

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
        """After a re-form: point what holds the old group at the new one (TorchState: DDP)."""

    def attach(self, inflight: InFlight) -> None:
        """Borrow ``inflight`` (the worker's group's, elastic.run hands it after each form), so
        that a release ends the collectives the state waits on: ``sync()``'s, and TorchState's
        DDP all-reduces.
        """
        self._inflight = inflight


class TorchState(State):
    """``TorchState(model=, optimizer=, **values)``: modules and optimizers too, by their
    ``state_dict``. A ``DistributedDataParallel`` model is rebuilt on each new group in
    place (``rewrap``), so the script's own reference to it stays valid.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **values: Any) -> None:
        self.model, self.optimizer = model, optimizer
        super().__init__(**values)

    def save(self) -> Any:
        saved = {"values": super().save()}
        if self.model is not None:
            saved["model"] = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        return saved

    def load(self, saved: Any) -> None:
        super().load(saved["values"])
        if self.model is not None and "model" in saved:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None and "optimizer" in saved:
            self.optimizer.load_state_dict(saved["optimizer"])
            self.optimizer.zero_grad(set_to_none=True)  # a step cut short left its gradients

    def rewrap(self) -> None:
        """A DDP model becomes, in place, the one a newcomer's script builds now: a fresh
        ``DistributedDataParallel`` over the same module and the new default group, whose
        attributes replace the old wrapper's (the script's reference to it stays valid).

        Why fresh rather than ``_update_process_group``: survivors and newcomers must run the
        same collectives in the same order. The constructor's (parameter shapes, module states
        from rank 0) come with it, and so does the reducer's state: a reset reducer that
        remembered its first iteration rebuilt its buckets one iteration before a newcomer's
        did, a broadcast met an allreduce, and the gradients of that step were wrong
        (tests/pytorch/test_in_place.py, "arrive"). The old reducer goes with the old
        attributes, its autograd hooks with it.

        The script's own communication hooks are registered again on the fresh wrapper, as a
        newcomer's script registers them on its own: survivors and newcomers then reduce
        gradients the same way (a hook of another kind, PowerSGD say, runs other collectives).
        A hook's state that names the old process group itself, rather than None for the
        default one, would still name it: the limit of carrying a hook over. etcdrun's own hook
        is not carried: ``attach`` gives the fresh wrapper one of the new group's.
        """
        from torch.nn.parallel import DistributedDataParallel

        m = self.model
        if not isinstance(m, DistributedDataParallel):
            return
        scripts = [(h, s) for h, s in m._comm_hooks if not isinstance(s, InFlight)]
        fresh = DistributedDataParallel(
            m.module,
            device_ids=m.device_ids,
            output_device=m.output_device,
            dim=m.dim,
            bucket_cap_mb=m.bucket_bytes_cap / (1024 * 1024),
            find_unused_parameters=m.find_unused_parameters,
            gradient_as_bucket_view=m.gradient_as_bucket_view,
            static_graph=m.static_graph,
            forward_sync_buffers=m.forward_sync_buffers,
            skip_all_reduce_unused_params=m.skip_all_reduce_unused_params,
            mixed_precision=m.mixed_precision,
        )
        own = [h for h, _ in fresh._comm_hooks]  # DDP's own (mixed precision's) come anew
        m.__dict__.update(fresh.__dict__)
        for hook, hook_state in scripts:
            if hook not in own:
                m.register_comm_hook(hook_state, hook)

    def attach(self, inflight: InFlight) -> None:
        from torch.nn.parallel import DistributedDataParallel

        super().attach(inflight)
        if isinstance(self.model, DistributedDataParallel):
            inflight.hook(self.model)


def _device() -> Any:
    """Where the group's tensors live: NCCL's on the worker's GPU, gloo's on the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dumps(saved: Any) -> bytes:
    """Pickled with torch's tensor support (state dicts hold tensors)."""
    import torch

    buf = io.BytesIO()
    torch.save(saved, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


__all__ = ["State", "TorchState"]
