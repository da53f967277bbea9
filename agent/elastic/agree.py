"""The agreement check: after a sync, every rank's live state is the source's, or nobody trains.

Why: a sync gives every rank the same committed state, and a restore puts it into the live
objects, but only through the handlers (handlers.py). A value a handler does not fully carry
(a scheduler deep-copied away from its optimizer, a user's handler that forgets a field) leaves
one rank on another state, and data-parallel training then goes on with replicas that part:
each steps with its own weights or learning rate, and nothing fails. So after every sync:

- each rank compares its live shared state, value by value, with the state it just synced
  (tensors byte for byte, plain values by equality): what a handler did not carry differs;
- the ranks gather, in one all_gather of two numbers per value, a fingerprint of the synced
  state (a digest of its plain values and the sum of its tensors' bytes) and their own verdict,
  so that a transport that delivered other bytes to one rank is caught too.

Any value that differs ends the round with ``ReplicasDiverged``: a failure of the job
(restarted from its checkpoint as any failure), never a silent divergence.

Why not a digest of the whole live state on every rank: sha1 reads about 1.7 GB/s here, and
the check would then cost more than the sync it checks (bench/results/state_sync.md). A
comparison and a byte sum read memory at several GB/s, and need no more of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

CHUNK = 32 * 1024 * 1024  # a device tensor is compared through host copies of this size


class ReplicasDiverged(RuntimeError):
    """Ranks hold different states after a sync: training would go on with parted replicas."""


def check(
    live: dict[str, Any],
    synced: dict[str, Any],
    src: int,
    wait: Callable[[Any], None],
    device: Any,
) -> None:
    """Raise ``ReplicasDiverged`` naming the values where a rank's live state is not the synced
    one, or where ranks synced other bytes than rank ``src``. ``live`` and ``synced``: each
    shared value's tree (its handler's, or the plain value), in the same order on every rank.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or not synced:
        return
    names = list(synced)
    rows = []
    for name in names:
        same = name in live and equal(live[name], synced[name])
        rows.append([*fingerprint(synced[name]), int(same)])
    mine = torch.tensor(rows, dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    wait(dist.all_gather(every, mine, async_op=True))
    ref = every[src].cpu()
    parted: dict[str, list[int]] = {}
    for rank, theirs in enumerate(every):
        theirs = theirs.cpu()
        for i, name in enumerate(names):
            if not bool(theirs[i, 2]) or not torch.equal(theirs[i, :2], ref[i, :2]):
                parted.setdefault(name, []).append(rank)
    if parted:
        where = "; ".join(f"{n} on rank(s) {r}" for n, r in parted.items())
        raise ReplicasDiverged(
            f"after the sync, ranks hold a state other than rank {src}'s: {where} "
            "(a handler that does not carry the whole value? see elastic.register_handler)"
        )


def equal(a: Any, b: Any) -> bool:
    """Whether two trees hold the same values: tensors of one dtype and shape, byte for byte
    (so NaNs compare equal), containers alike, plain values by ``==``.
    """
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and _same_bytes(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(equal(a[k], b[k]) for k in a)
    if type(a) in (list, tuple) and type(a) is type(b):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b) or (a != a and b != b)  # NaN == NaN here
    except Exception:  # noqa: BLE001 - a value that cannot say: taken as different
        return False


def fingerprint(tree: Any) -> tuple[int, int]:
    """Two numbers that differ, but for a vanishing chance, when the tree's plain values or its
    tensors' bytes differ: a digest of a canonical text of the plain values and shapes, and the
    sum of every tensor's memory as integer words.
    """
    import torch

    h = hashlib.sha1()
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            total = _wrapped(total + _byte_sum(x.detach()))
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
    return int.from_bytes(h.digest()[:8], "little", signed=True), total


def _wrapped(n: int) -> int:
    """``n`` as a signed 64-bit integer wraps it: what an int64 tensor can carry."""
    return (n + (1 << 63)) % (1 << 64) - (1 << 63)


def _bytes(t: Any) -> Any:
    """``t``'s memory as the widest integer words that divide it: torch compares and sums
    int64 words at several GB/s, single bytes at a tenth of that.
    """
    import torch

    flat = t.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if not flat.numel():
        return flat.new_empty(0, dtype=torch.uint8)
    raw = flat.view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if raw.numel() % word.itemsize == 0 and raw.data_ptr() % word.itemsize == 0:
            return raw.view(word)
    return raw


def _same_bytes(a: Any, b: Any) -> bool:
    import torch

    x, y = _bytes(a), _bytes(b)
    if x.device == y.device:
        return torch.equal(x, y)
    for start in range(0, x.numel(), CHUNK):
        if not torch.equal(x[start : start + CHUNK].cpu(), y[start : start + CHUNK].cpu()):
            return False
    return True


def _byte_sum(t: Any) -> int:
    """The sum of ``t``'s memory as integer words (exact, wrapping at 64 bits), read where
    ``t`` lives.
    """
    import torch

    return int(_bytes(t).sum(dtype=torch.int64))


def _canonical(x: Any) -> str:
    """A text of a plain value that is the same in every process: sets sorted (their order
    follows the process's hash seed), floats exact.
    """
    if isinstance(x, set | frozenset):
        return "set(" + ",".join(sorted(_canonical(v) for v in x)) + ")"
    if isinstance(x, float):
        return x.hex()
    return f"{type(x).__name__}:{x!r}"


__all__ = ["ReplicasDiverged", "check", "equal", "fingerprint"]
