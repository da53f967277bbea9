"""ElasticSampler: each rank's share of the samples this epoch has not consumed yet, for the world
it runs in now.

Why not torch's ``DistributedSampler``: it deals an epoch out once, for one world size, and
keeps no position. After a membership change the survivors would start the epoch again (the
same samples seen twice) or a newcomer would start it from the beginning while the others are
halfway (replicas on different data). Horovod's ``ElasticSampler`` answers with the set of
processed indices; here a count is enough, because data-parallel ranks consume in lockstep.

How: the epoch's order is a permutation drawn from ``seed + epoch`` (the same on every rank).
``consumed`` counts the samples of that order the whole job has trained on; each step, every
rank calls ``record_batch(batch_size)``, adding ``batch_size * world_size``. An iterator deals
the rest, ``order[consumed:]``, to the ranks by stride (rank r takes positions r, r + W, ...),
so the samples a step consumes are always a prefix of the rest, and after a change of world the
next iterator deals what is left to the new ranks. Its position is state: put the sampler in
the ``State`` (``State(sampler=sampler)``), and start a new iterator at the top of the training
function (or in an ``on_reset`` callback), as after any re-form.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ElasticSampler:
    """``ElasticSampler(dataset_or_length, shuffle=True, seed=0, drop_last=False)``: a sampler
    for ``torch.utils.data.DataLoader(dataset, sampler=..., batch_size=B)``. ``drop_last``:
    leave out the tail that does not fill every rank (else the tail is padded from the start
    of the order, as ``DistributedSampler`` does).
    """

    def __init__(
        self,
        data: Sized | int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.length = data if isinstance(data, int) else len(data)
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        """A new epoch: a new order, nothing consumed yet."""
        self.epoch, self.consumed = epoch, 0

    def record_batch(self, batch_size: int) -> None:
        """Every rank trained on ``batch_size`` more samples of this epoch (call it once per
        step, on every rank, before ``commit()``).
        """
        self.consumed += batch_size * _world()[1]

    def order(self) -> list[int]:
        """The epoch's order of every sample."""
        import torch

        if not self.shuffle:
            return list(range(self.length))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=g).tolist()

    def _mine(self) -> list[int]:
        rank, world = _world()
        rest = self.order()[self.consumed :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % world]
        elif rest and len(rest) % world:
            pad = world - len(rest) % world
            rest += (rest * (pad // len(rest) + 1))[:pad]
        return rest[rank::world]

    def __iter__(self) -> Iterator[int]:
        return iter(self._mine())

    def __len__(self) -> int:
        return len(self._mine())

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.epoch, self.consumed, self.seed = saved["epoch"], saved["consumed"], saved["seed"]


__all__ = ["ElasticSampler"]
