"""A worker for the straggler test; argv: <out dir>.

Records each start as tests/agent_scripts/worker.py does (``start_<round>_<rank>_<pid>.json``).
Each step does ``WORK`` seconds of its own CPU work (a busy loop: the straggler signal is CPU
time), then sleeps until the step's end, as a rank that waits in ``all_reduce`` for its peers
would; then ``etcdrun.elastic.progress(step)``. On the node whose agent has
``ETCDRUN_TEST_SLOW=1``, once ``<out dir>/slow`` exists, a step's work is 5x longer (the step's
wall time stays the same: the others do not wait for it here, but its CPU per step is what
differs in synchronous training too). Every worker returns once ``<out dir>/stop`` exists.
"""

import json
import os
import sys
import time

from etcdrun import elastic

WORK = 0.008  # CPU seconds per step
STEP = 0.1  # wall seconds per step


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as fp:
        json.dump(data, fp)
    os.replace(path + ".tmp", path)


def main(out: str) -> None:
    rank, rnd = os.environ["RANK"], os.environ["ETCDRUN_ROUND"]
    _write(
        os.path.join(out, f"start_{rnd}_{rank}_{os.getpid()}.json"),
        {"env": dict(os.environ), "pid": os.getpid(), "ppid": os.getppid(), "t": time.time()},
    )
    slow_node = os.environ.get("ETCDRUN_TEST_SLOW") == "1"
    step = 0
    while not os.path.exists(os.path.join(out, "stop")):
        began = time.monotonic()
        slow = slow_node and os.path.exists(os.path.join(out, "slow"))
        until = time.process_time() + WORK * (5 if slow else 1)
        while time.process_time() < until:
            pass
        step += 1
        elastic.progress(step)
        time.sleep(max(0.0, STEP - (time.monotonic() - began)))


if __name__ == "__main__":
    main(sys.argv[1])
