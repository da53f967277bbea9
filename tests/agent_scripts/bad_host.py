"""A worker for the bad-host cooldown test; argv: <out dir>.

Records each start as tests/agent_scripts/worker.py does (``start_<round>_<rank>_<pid>.json``).
On the node whose agent has ``ETCDRUN_TEST_BAD_HOST=1``, and while ``<out dir>/healed`` does not
exist, every worker raises once all the workers of its round have started: that node's workers
fail in every round it joins. Elsewhere a worker sleeps until stopped, except in a round of the
whole job (WORLD_SIZE = ``<out dir>/whole``'s number) once the bad host is healed: then every
worker returns, and the job succeeds.
"""

import json
import os
import sys
import time

from etcdrun.agent.errors import record


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as fp:
        json.dump(data, fp)
    os.replace(path + ".tmp", path)


def _all_started(out: str, timeout: float = 30.0) -> None:
    prefix = f"start_{os.environ['ETCDRUN_ROUND']}_"
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = {n.split("_")[2] for n in os.listdir(out) if n.startswith(prefix)}
        if len(ranks) >= world:
            return
        time.sleep(0.02)


@record
def main(out: str) -> None:
    healed = os.path.exists(os.path.join(out, "healed"))
    if os.environ.get("ETCDRUN_TEST_BAD_HOST") == "1" and not healed:
        _all_started(out)
        raise RuntimeError(f"bad host: rank {os.environ['RANK']} fails")
    whole = int(open(os.path.join(out, "whole")).read())
    if healed and int(os.environ["WORLD_SIZE"]) == whole:
        return
    for _ in range(1200):
        time.sleep(0.1)


if __name__ == "__main__":
    OUT = sys.argv[1]
    _write(
        os.path.join(
            OUT, f"start_{os.environ['ETCDRUN_ROUND']}_{os.environ['RANK']}_{os.getpid()}.json"
        ),
        {"env": dict(os.environ), "pid": os.getpid(), "ppid": os.getppid(), "t": time.time()},
    )
    main(OUT)
