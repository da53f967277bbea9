"""The committed copy of a state: its tensors on the host, in buffers kept from commit to commit.

Why not a deep copy per commit: a deep copy allocates the whole state again at every step, on
the device for CUDA tensors (a model's worth of device memory, twice, at the moment training
needs it most). A commit copies each tensor into a host buffer it already holds from the commit
before (a memcpy on the CPU, a device-to-host copy on a GPU, into pinned memory so that it runs
without the CPU waiting on each tensor) and allocates only when a tensor's dtype or shape
changed. What is copied is the tree the handlers hand out (handlers.py): its tensors become
leaves of a list, its containers and plain values a skeleton, rebuilt per commit (they are
small). The same split is what ``sync()`` sends (stream.py): the skeleton once, the tensors one
after another, into the receiver's own buffers.

Limits: the buffers are reused in place, so a tree handed out by ``part(key, clone=False)`` is
only valid until the next commit; ``restore()`` asks ``part`` for clones wherever a handler
would keep the tensors it is given.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Leaf:
    """Where a tensor sits in a skeleton: its index in the leaves, what it holds."""

    index: int
    dtype: str  # torch's name for it, e.g. "float32"
    shape: tuple[int, ...]
    device: str  # the live tensor's device type ("cpu", "cuda"): where a restore puts it

    @property
    def torch_dtype(self) -> Any:
        return _dtype(self.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.torch_dtype.itemsize


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _rebuild(x: Any, leaf: Any, is_leaf: Any) -> Any:
    """``x`` with each leaf (``is_leaf``) replaced by ``leaf(it)``: dicts (their type and
    attributes kept: a state_dict's ``_metadata``), lists and tuples rebuilt, any other value
    copied.
    """
    if is_leaf(x):
        return leaf(x)
    if isinstance(x, dict):
        out = copy.copy(x)
        for k, v in x.items():
            out[k] = _rebuild(v, leaf, is_leaf)
        return out
    if type(x) in (list, tuple):
        return type(x)(_rebuild(v, leaf, is_leaf) for v in x)
    return copy.deepcopy(x)


def flatten(tree: Any) -> tuple[Any, list[Any]]:
    """The tree's skeleton (tensors replaced by ``Leaf``; containers rebuilt, other values
    copied) and its tensors in the order a walk meets them.
    """
    import torch

    leaves: list[Any] = []

    def mark(t: Any) -> Leaf:
        leaves.append(t)
        dtype = str(t.dtype).removeprefix("torch.")
        return Leaf(len(leaves) - 1, dtype, tuple(t.shape), t.device.type)

    skeleton = _rebuild(tree, mark, lambda x: isinstance(x, torch.Tensor))
    return skeleton, leaves


def unflatten(skeleton: Any, leaves: list[Any] | dict[int, Any]) -> Any:
    """The tree again, with ``leaves`` (by index) in the places their ``Leaf`` marks."""
    return _rebuild(skeleton, lambda m: leaves[m.index], lambda x: isinstance(x, Leaf))


def leaf_marks(skeleton: Any) -> list[Leaf]:
    """The skeleton's ``Leaf`` marks, by index."""
    found: list[Leaf] = []

    def walk(x: Any) -> None:
        if isinstance(x, Leaf):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif type(x) in (list, tuple):
            for v in x:
                walk(v)

    walk(skeleton)
    return sorted(found, key=lambda leaf: leaf.index)


@dataclass
class Saved:
    """A tree as the state keeps it: its skeleton and its tensors on the host."""

    skeleton: Any
    tensors: list[Any] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def part(self, key: Any, clone: bool, place: bool = True) -> Any:
        """The tree under ``key`` of a skeleton that is a dict (a state's values by name), each
        tensor on the device type it was saved from (the rank's current CUDA device for
        "cuda"; ``place=False``: the host buffers as they are, to read); ``clone``: with
        tensors of its own, which outlive the next commit (a tensor moved to its device is a
        copy already).
        """
        sub = self.skeleton[key]
        if not place:
            return unflatten(sub, self.tensors)
        placed = {m.index: _placed(self.tensors[m.index], m.device, clone) for m in leaf_marks(sub)}
        return unflatten(sub, placed)


def _placed(t: Any, device: str, clone: bool) -> Any:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return t.to(torch.device("cuda", torch.cuda.current_device()), non_blocking=True)
    return t.clone() if clone else t


class Snapshot:
    """Host copies of one state's trees, made by ``take`` into buffers kept between calls.
    Not thread-safe: the main thread commits, restores and syncs.
    """

    def __init__(self) -> None:
        self._buffers: list[Any] = []

    def take(self, tree: Any) -> Saved:
        """Copy ``tree``'s tensors into this snapshot's buffers (the previous commit's, where
        dtype and shape match) and its skeleton; the previous ``Saved`` is overwritten.
        """
        import torch

        skeleton, leaves = flatten(tree)
        copies = [self._buffer(i, t) for i, t in enumerate(leaves)]
        waits = False
        for dst, src in zip(copies, leaves, strict=True):
            on_device = src.device.type != "cpu"
            dst.copy_(src.detach(), non_blocking=on_device and dst.is_pinned())
            waits = waits or on_device
        if waits and torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies are complete before anyone reads them
        del self._buffers[len(copies) :]
        return Saved(skeleton, copies)

    def adopt(self, saved: Saved) -> None:
        """Keep ``saved``'s tensors as the buffers of the next ``take`` (a sync received them)."""
        self._buffers = list(saved.tensors)

    def reusable(self) -> Iterator[Any]:
        """The buffers in leaf order: where a sync may receive a tree of the same layout."""
        return iter(self._buffers)

    def _buffer(self, i: int, like: Any) -> Any:
        import torch

        if i < len(self._buffers):
            buf = self._buffers[i]
            if buf.dtype == like.dtype and buf.shape == like.shape:
                return buf
        pin = like.device.type == "cuda" and torch.cuda.is_available()
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf


__all__ = ["Leaf", "Saved", "Snapshot", "flatten", "leaf_marks", "unflatten"]
