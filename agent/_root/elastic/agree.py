"""The agreement check: after a sync, every rank's live state is the source's, or nobody trains.

Why: a sync gives every rank the same committed state, and a restore puts it into the live
objects, but only through the handlers (handlers.py). A value a handler does not fully carry
(a scheduler deep-copied away from its optimizer, a user's handler that forgets a field) leaves
one rank on another state, and data-parallel training then goes on with replicas that part:
each steps with its own weights or learning rate, and nothing fails. So after every sync each
rank digests its live shared state, value by value (sha1 over each tensor's bytes and over a
canonical text of the plain values), the ranks gather the digests in one collective, and any
value that differs from the source's ends the round with ``ReplicasDiverged``: a failure of the
job (restarted from its checkpoint as any failure), never a silent divergence.

Cost: one read of the state's bytes (sha1 runs at several hundred MB/s per core here and
releases the GIL) and one all_gather of 16 bytes per value, at each re-form only.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Callable
from typing import Any

CHUNK = 32 * 1024 * 1024  # a device tensor is digested through host copies of this size


class ReplicasDiverged(RuntimeError):
    """Ranks hold different states after a sync: training would go on with parted replicas."""


def digest(tree: Any) -> bytes:
    """16 bytes that differ when any tensor's bytes or any plain value of ``tree`` differ."""
    import torch

    h = hashlib.sha1()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            _tensor_bytes(x.detach(), h.update)
        elif isinstance(x, dict):
            h.update(b"{")
            for k, v in x.items():
                h.update(_canonical(k).encode())
                walk(v)
            h.update(b"}")
        elif type(x) in (list, tuple):
            h.update(b"[")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(_canonical(x).encode())

    walk(tree)
    return h.digest()[:16]


def check(named: dict[str, Any], src: int, wait: Callable[[Any], None], device: Any) -> None:
    """Raise ``ReplicasDiverged`` naming the values where a rank differs from rank ``src``.
    ``named``: each shared value's tree, in the same order on every rank.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or not named:
        return
    names = list(named)
    mine = torch.tensor(
        [list(_words(digest(named[n]))) for n in names], dtype=torch.int64, device=device
    )
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    wait(dist.all_gather(every, mine, async_op=True))
    ref = every[src].cpu()
    parted: dict[str, list[int]] = {}
    for rank, theirs in enumerate(every):
        for i, same in enumerate((theirs.cpu() == ref).all(dim=1).tolist()):
            if not same:
                parted.setdefault(names[i], []).append(rank)
    if parted:
        where = "; ".join(f"{n} on rank(s) {r}" for n, r in parted.items())
        raise ReplicasDiverged(
            f"after the sync, ranks hold a state other than rank {src}'s: {where} "
            "(a handler that does not carry the whole value? see elastic.register_handler)"
        )


def _words(d: bytes) -> tuple[int, int]:
    return int.from_bytes(d[:8], "little", signed=True), int.from_bytes(
        d[8:], "little", signed=True
    )


def _tensor_bytes(t: Any, update: Callable[[Any], None]) -> None:
    """Feed ``t``'s bytes to ``update``: in place from host memory, in chunks from a device."""
    import torch

    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    if raw.device.type == "cpu":
        if raw.numel():
            update(memoryview((ctypes.c_char * raw.numel()).from_address(raw.data_ptr())))
        return
    for start in range(0, raw.numel(), CHUNK):
        host = raw[start : start + CHUNK].cpu()
        update(memoryview((ctypes.c_char * host.numel()).from_address(host.data_ptr())))


def _canonical(x: Any) -> str:
    """A text of a plain value that is the same in every process: sets sorted (their order
    follows the process's hash seed), floats exact.
    """
    if isinstance(x, set | frozenset):
        return "set(" + ",".join(sorted(_canonical(v) for v in x)) + ")"
    if isinstance(x, float):
        return x.hex()
    return f"{type(x).__name__}:{x!r}"


__all__ = ["ReplicasDiverged", "check", "digest"]
