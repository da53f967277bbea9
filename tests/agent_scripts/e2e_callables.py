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


def fail_once_on_rank_1():
    """Rank 1 fails in the first attempt only; every worker returns the restart count."""
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restarts == 0 and os.environ["RANK"] == "1":
        raise ValueError("rank 1 fails the first attempt")
    return restarts


def always_fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 always fails")
    return 0


def nap(seconds):
    """A workload of a known length (not a synchronisation: nothing waits on it)."""
    import time

    time.sleep(seconds)
    return os.environ["RANK"]


def run_until_go(marker_dir):
    """Announce this attempt's start; return at once when ``go`` existed before the
    announcement, else sleep until stopped.

    Why look before announcing: a test touches ``go`` once it has seen every announcement, so a
    worker that looked after announcing could see it and end before the agent stops it.
    """
    import time

    rank, pid = os.environ["RANK"], os.getpid()
    go = os.path.exists(os.path.join(marker_dir, "go"))
    with open(os.path.join(marker_dir, f"ready_{rank}_{pid}"), "w") as fp:
        fp.write(str(pid))
    if go:
        return rank
    time.sleep(600)
    return None


def environment():
    """The worker's environment as user code sees it."""
    return dict(os.environ)
