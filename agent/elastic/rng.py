"""RandomState: the process's random generators, as one value of a ``State``.

Why a value of its own: a step computed again after a restore must draw the same random numbers
(dropout masks, augmentations, shuffles) as the first time, or the replay is another step. The
generators are torch's CPU one, every initialised CUDA device's, Python's ``random``, and
numpy's global one when the script has imported numpy (etcdrun never imports it: torch does
not bring it).

Why per rank by default: ranks usually draw different numbers on purpose (each its own dropout
mask), so a commit keeps and a restore puts back *this* rank's generators, and ``sync()`` leaves
them alone; a newcomer keeps its own. ``RandomState(per_rank=False)`` is for a job whose ranks
draw the same numbers: then every rank takes the source rank's generators at a sync, as the
rest of the state.
"""

from __future__ import annotations

import random
import sys
from typing import Any

from etcdrun.elastic.handlers import register_handler


class RandomState:
    """Put it in a state as any value: ``elastic.State(step=0, rng=elastic.RandomState())``."""

    def __init__(self, per_rank: bool = True) -> None:
        self.per_rank = per_rank

    def state_dict(self) -> dict[str, Any]:
        import torch

        saved: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            saved["cuda"] = torch.cuda.get_rng_state_all()
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # the script's own import; as plain values, so none is needed
            kind, keys, pos, has_gauss, gauss = numpy.random.get_state(legacy=True)
            saved["numpy"] = (kind, [int(k) for k in keys], pos, has_gauss, gauss)
        return saved

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        import torch

        torch.set_rng_state(saved["torch"])
        random.setstate(saved["python"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])
        numpy = sys.modules.get("numpy")
        if "numpy" in saved and numpy is not None:
            kind, keys, pos, has_gauss, gauss = saved["numpy"]
            numpy.random.set_state(
                (kind, numpy.asarray(keys, dtype="uint32"), pos, has_gauss, gauss)
            )


def _load(rng: RandomState, saved: dict[str, Any]) -> None:
    rng.load_state_dict(saved)


register_handler(RandomState, RandomState.state_dict, _load, per_rank=lambda rng: rng.per_rank)

__all__ = ["RandomState"]
