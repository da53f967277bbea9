"""The worker whose RANK is argv[1] raises under @record; the others sleep until stopped."""

import os
import sys
import time

from etcdrun.agent.errors import record


def train_step(rank: int) -> None:
    raise ValueError(f"boom from rank {rank}")


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    if rank == int(sys.argv[1]):
        train_step(rank)
    time.sleep(120)


if __name__ == "__main__":
    main()
