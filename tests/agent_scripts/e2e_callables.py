"""Callable entrypoints for the launcher's tests (module level, so that spawn can pickle them)."""

import os


def rank_times(factor):
    """What a worker returns travels back to ``elastic_launch``'s caller, by global rank."""
    return {
        "value": int(os.environ["RANK"]) * factor,
        "world_size": os.environ["WORLD_SIZE"],
        "run_id": os.environ["TORCHELASTIC_RUN_ID"],
        "pid": os.getpid(),
    }
