"""``sync()``'s transport: one rank's committed state to every rank, tensor by tensor.

Why not one pickled blob: pickling a state puts every tensor's bytes into one Python bytes
object, then into a tensor to broadcast, then back out on every receiver (several host copies of
the whole state, and the decoding needed numpy, which torch does not bring: every in-place
worker of a job without numpy died at its first sync). Here only the skeleton is pickled (the
containers and plain values a handler's tree holds: small); the tensors are broadcast from the
source's host copy straight into each receiver's own buffers (the ones its last commit filled,
where dtype and shape match), in pieces of at most ``BUCKET_BYTES``:

- on gloo, a tensor of ``IN_PLACE_BYTES`` or more is broadcast in place, from and into that
  tensor's memory, a bucket at most at a time: no copy at all;
- smaller tensors are packed into one bucket per broadcast (a collective per tensor would cost
  more in latency than in bytes), and NCCL's pieces pass through one bucket on the device.

Why in place from 1 MB on gloo, not only for tensors larger than a bucket: packing copies every
byte twice (into the bucket at the source, out of it at each receiver), and on loopback those
copies cost more than a collective per tensor does from 1 MB up (bench/state_sync.py, a 1 GB
Adam state: 1.4 GB/s packed, about 1.65 in place; staging then holds only the small tensors).

So the memory a sync needs beyond the state itself is one bucket at most. Every collective is
waited on through the caller's ``wait`` (the group's ``InFlight``), so that a release ends a
sync too.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from etcdrun.elastic.snapshot import Leaf, Saved, leaf_marks

BUCKET_BYTES = 32 * 1024 * 1024  # read at each broadcast; bench/state_sync.py measures others
IN_PLACE_BYTES = 1024 * 1024  # gloo: a tensor this large goes alone, from and into its memory


@dataclass(frozen=True)
class _Piece:
    leaf: int
    start: int  # bytes into the tensor
    length: int


def broadcast(
    saved: Saved | None,
    src: int,
    wait: Callable[[Any], None],
    device: Any,
    reuse: Iterator[Any],
    bucket_bytes: int | None = None,
) -> tuple[Saved, int]:
    """Every rank gets ``saved`` of rank ``src`` (``saved`` is None elsewhere); returns it and
    the bytes sent. ``reuse``: host tensors, in leaf order, that a receiver may overwrite.
    ``bucket_bytes``: the pieces' size, by default ``BUCKET_BYTES`` as it is at the call (the
    same on every rank).
    """
    import torch
    import torch.distributed as dist

    mine = dist.get_rank() == src
    header = _header(saved.skeleton if mine else None, src, wait, device)
    skeleton = saved.skeleton if mine else pickle.loads(header)
    marks = leaf_marks(skeleton)
    if mine:
        tensors = saved.tensors
    else:
        pin = device.type == "cuda"
        tensors = [_destination(mark, reuse, pin) for mark in marks]
    views = [_bytes_of(t) for t in tensors]
    in_place = device.type == "cpu"  # gloo: a lone piece goes from and into its tensor
    bucket_bytes = bucket_bytes or BUCKET_BYTES
    alone = min(IN_PLACE_BYTES, bucket_bytes) if in_place else bucket_bytes
    plan = list(_buckets(marks, bucket_bytes, alone))
    staged = [sum(p.length for p in b) for b in plan if not (in_place and len(b) == 1)]
    staging = torch.empty(max(staged, default=0), dtype=torch.uint8, device=device)
    for bucket in plan:
        if in_place and len(bucket) == 1:  # no copy on either side
            p = bucket[0]
            wait(dist.broadcast(views[p.leaf][p.start : p.start + p.length], src, async_op=True))
            continue
        size = sum(p.length for p in bucket)
        at = 0
        if mine:
            for p in bucket:
                staging[at : at + p.length].copy_(views[p.leaf][p.start : p.start + p.length])
                at += p.length
        wait(dist.broadcast(staging[:size], src, async_op=True))
        if not mine:
            at = 0
            for p in bucket:
                views[p.leaf][p.start : p.start + p.length].copy_(staging[at : at + p.length])
                at += p.length
    sent = len(header) + sum(m.nbytes for m in marks)
    return Saved(skeleton, tensors), sent


def _header(skeleton: Any, src: int, wait: Callable[[Any], None], device: Any) -> bytes:
    """The skeleton, pickled at ``src``, broadcast: its length, then its bytes."""
    import ctypes

    import torch
    import torch.distributed as dist

    if skeleton is not None:
        data = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    wait(dist.broadcast(size, src, async_op=True))
    n = int(size.item())
    if skeleton is not None:
        blob = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        blob = torch.empty(n, dtype=torch.uint8, device=device)
    wait(dist.broadcast(blob, src, async_op=True))
    if skeleton is not None:
        return data
    host = blob.cpu()
    return ctypes.string_at(host.data_ptr(), n)  # no numpy: torch does not bring it


def _destination(mark: Leaf, reuse: Iterator[Any], pin: bool) -> Any:
    """The receiver's buffer for ``mark``: its own from the last commit when dtype and shape
    match (the layout of a state rarely changes), else a new one.
    """
    import torch

    own = next(reuse, None)
    dtype = mark.torch_dtype
    if own is not None and own.dtype == dtype and tuple(own.shape) == mark.shape:
        return own
    return torch.empty(mark.shape, dtype=dtype, device="cpu", pin_memory=pin)


def _bytes_of(t: Any) -> Any:
    """A flat uint8 view of a contiguous tensor's memory (what a broadcast carries)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def _buckets(marks: list[Leaf], bucket_bytes: int, alone: int) -> Iterator[list[_Piece]]:
    """The pieces to broadcast, grouped: a tensor of ``alone`` bytes or more goes by itself,
    cut into pieces of a bucket at most; smaller ones share a bucket.
    """
    bucket: list[_Piece] = []
    filled = 0
    for mark in marks:
        n = mark.nbytes
        if n == 0:
            continue
        if n >= alone:
            for start in range(0, n, bucket_bytes):
                yield [_Piece(mark.index, start, min(bucket_bytes, n - start))]
            continue
        if filled + n > bucket_bytes:
            yield bucket
            bucket, filled = [], 0
        bucket.append(_Piece(mark.index, 0, n))
        filled += n
    if bucket:
        yield bucket


__all__ = ["BUCKET_BYTES", "IN_PLACE_BYTES", "broadcast"]
