"""A worker for the agent's end-to-end tests; argv: <out dir> <mode> [<rank>].

Every start leaves ``start_<round>_<rank>_<pid>.json`` in <out dir> (its environment, pid, parent
pid, wall time), written atomically so a test polling the folder never reads half a file. A
SIGTERM is recorded in ``signal_<pid>.json`` before the worker dies of it, so a test can tell
"the agent forwarded SIGTERM" from "the worker was SIGKILLed".

Modes: ``exit`` returns at once (success); ``sleep`` waits until stopped; ``deaf`` too, but it
records a SIGTERM and goes on (a worker stuck in a collective: only SIGKILL ends it);
``fail <rank>`` makes the worker whose RANK is <rank> raise under ``@record`` while the others
sleep; ``raw <rank>`` the same without ``@record`` (no error file: only its stderr tells). It
raises only once every worker of its round has recorded its start: a test then sees every
attempt whole.
"""

import json
import os
import signal
import sys
import time

from etcdrun.agent.errors import record


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as fp:
        json.dump(data, fp)
    os.replace(path + ".tmp", path)


def _on_term(signum, frame):
    _write(
        os.path.join(OUT, f"signal_{os.getpid()}.json"),
        {
            "signal": signum,
            "rank": os.environ["RANK"],
            "round": os.environ["ETCDRUN_ROUND"],
            "t": time.time(),
        },
    )
    if sys.argv[2] == "deaf":
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _all_started(timeout: float = 30.0) -> None:
    prefix = f"start_{os.environ['ETCDRUN_ROUND']}_"
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = {
            name.split("_")[2]
            for name in os.listdir(OUT)
            if name.startswith(prefix) and name.endswith(".json")
        }
        if len(ranks) >= world:
            return
        time.sleep(0.02)


def train_step(rank: int) -> None:
    raise ValueError(f"boom from rank {rank}")


def run() -> None:
    mode = sys.argv[2]
    rank = int(os.environ["RANK"])
    if mode in ("fail", "raw") and rank == int(sys.argv[3]):
        _all_started()
        train_step(rank)
    if mode != "exit":
        for _ in range(1200):
            time.sleep(0.1)


main = record(run)


if __name__ == "__main__":
    OUT = sys.argv[1]
    signal.signal(signal.SIGTERM, _on_term)
    _write(
        os.path.join(
            OUT, f"start_{os.environ['ETCDRUN_ROUND']}_{os.environ['RANK']}_{os.getpid()}.json"
        ),
        {"env": dict(os.environ), "pid": os.getpid(), "ppid": os.getppid(), "t": time.time()},
    )
    (run if sys.argv[2] == "raw" else main)()
