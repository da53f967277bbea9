"""A gloo job where one rank hangs once, for the hang watchdog's tests (tests/pytorch/test_hang.py)
and bench/hang.py.

argv: out_dir mode stuck_rank stuck_step [filetimer_s]. ``mode``: ``sleep`` (Python sleeps inside a
step while its peers wait in all_reduce), ``read`` (blocked in C: ``os.read`` on a pipe nobody
writes), ``stop`` (the process stops itself with SIGSTOP: no stack can come). Only in the first
attempt; in any later round (a restart, a new membership) the job runs a few steps and ends. Each
rank appends JSON lines to ``<out_dir>/rank<R>.jsonl``: its steps, and the wall time of its last
progress before hanging (and its pid). ``filetimer_s`` (bench/hang.py, torchrun's side): every step
runs inside torch's ``expires(after=filetimer_s)``, the FileTimer way of finding a hang.
"""

import contextlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from etcdrun import elastic

out_dir, mode, stuck_rank, stuck_step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
timer_s = float(sys.argv[5]) if len(sys.argv) > 5 else None
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
later = attempt > 0 or int(os.environ.get("ETCDRUN_ROUND", "1")) > 1  # a restart, or a new round
path = os.path.join(out_dir, f"rank{rank}.jsonl")


def say(**fields):
    with open(path, "a") as fp:
        fp.write(json.dumps({"rank": rank, "attempt": attempt, **fields}) + "\n")


if timer_s is not None:
    from torch.distributed.elastic.timer import FileTimerClient, configure, expires

    configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))


def guarded():
    return expires(after=timer_s) if timer_s is not None else contextlib.nullcontext()


def step_once(step):
    if attempt == 0 and rank == stuck_rank and step == stuck_step:
        say(hang=mode, step=step, last_progress=time.time(), pid=os.getpid())
        if mode == "sleep":
            time.sleep(3600)
        elif mode == "read":
            r, w = os.pipe()
            os.read(r, 1)
        else:
            os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(t)


t = torch.ones(1)
for step in range(100000):
    with guarded():
        step_once(step)
    elastic.progress(step)
    say(step=step)
    if later and step >= 3:
        break
    time.sleep(0.02)
dist.destroy_process_group()
