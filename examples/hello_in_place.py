"""The demo's in-place worker: a step counter that survives a membership change in memory.

Run it under etcdrun (``examples/demo.py`` does when torch is installed): each rank sums its
rank over the group (one gloo ``all_reduce``, so a lost peer really blocks it), counts a step,
commits, and prints a line naming the round, its rank, the world size, its pid and the step.
When a node dies, the survivors' processes are not restarted: ``etcdrun.elastic.run`` releases
the blocked collective, re-forms the group for the new round and calls ``train`` again from the
last commit, so the lines go on with the same pid, a new round and the next step.

Why ``elastic.State`` and not ``TorchState``: the step is all this demo keeps; a real script
passes its model and optimizer (examples/ddp_elastic.py ``--in-place``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from etcdrun import elastic


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps to train (default 20)")
    parser.add_argument(
        "--interval", type=float, default=0.3, help="seconds a step takes (default 0.3)"
    )
    args = parser.parse_args()

    elastic.init_process_group("gloo")  # etcdrun's group: a release can end it, and only it
    state = elastic.State(step=0)

    @elastic.run
    def train(state: elastic.State) -> None:
        while state.step < args.steps:
            time.sleep(args.interval)  # the step's own work
            total = torch.tensor([dist.get_rank()])
            dist.all_reduce(total)  # blocks on a lost peer until etcdrun releases it
            state.step += 1
            state.commit()
            print(
                f"round {os.environ['ETCDRUN_ROUND']}: rank {dist.get_rank()} of "
                f"{dist.get_world_size()} (node {os.environ['GROUP_RANK']}, pid {os.getpid()}) "
                f"step {state.step}/{args.steps}",
                flush=True,
            )

    train(state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
