"""Callable entrypoints for tests (module level, so that spawn can pickle them)."""

import os
import time

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "ETCDRUN_ROUND", "TORCHELASTIC_ERROR_FILE")


def scaled_rank(factor):
    print(f"callable rank {os.environ['RANK']}", flush=True)
    return {
        "value": int(os.environ["RANK"]) * factor,
        "env": {k: os.environ[k] for k in KEYS},
        "pid": os.getpid(),
        "ppid": os.getppid(),
    }


def raise_on_rank(rank):
    if os.environ["RANK"] == str(rank):
        raise KeyError(f"callable failed on rank {rank}")
    time.sleep(120)


def sleep_forever(marker_dir):
    with open(os.path.join(marker_dir, f"ready_{os.environ['RANK']}"), "w") as fp:
        fp.write(str(os.getpid()))
    time.sleep(600)


def unpicklable_result():
    return lambda: None
