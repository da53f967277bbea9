"""The worker both launchers run in bench/compare.py; argv: ``allreduce`` or ``idle``.

Why these lines: the benchmark measures "workers running" from what the workers themselves say,
not from either launcher's logs, so both launchers are timed by the same clock and the same
definition. ``BENCH_START`` is printed first thing, before torch is imported (the launcher's own
share ends there); ``BENCH_READY`` once ``init_process_group("gloo")`` has returned, i.e. every
rank of the new world has met (that is "running"). Times are ``time.time()``: the harness and all
agents run on this one machine, so they share the clock.

``allreduce``: a one-element gloo all_reduce every 0.2 s, so a lost peer surfaces as a failing
collective (the only way torchrun learns of it). ``idle``: never talks after the init, so only a
launcher that watches membership itself notices a lost node.
"""

import os
import sys
import time

_ID = (
    f"world={os.environ.get('WORLD_SIZE')} rank={os.environ.get('RANK')} "
    f"group_rank={os.environ.get('GROUP_RANK')} "
    f"restart={os.environ.get('TORCHELASTIC_RESTART_COUNT')} "
    f"round={os.environ.get('ETCDRUN_ROUND')} pid={os.getpid()}"
)
print(f"BENCH_START t={time.time():.6f} {_ID}", flush=True)

import datetime  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "allreduce"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    print(f"BENCH_READY t={time.time():.6f} {_ID}", flush=True)
    t = torch.ones(1)
    deadline = time.monotonic() + 900  # never outlive a forgotten harness for long
    while time.monotonic() < deadline:
        if mode == "allreduce":
            dist.all_reduce(t)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
