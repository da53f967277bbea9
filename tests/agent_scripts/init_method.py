"""torch's launcher test job, rewritten: 4 gloo workers meet through ``--init-method`` (env:// or
tcp://host:port), all_reduce a one-hot vector and check that it sums to the world size. It ends
without destroy_process_group(), as torch's own script does: the case that aborted at exit.
"""

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init-method", required=True)
    init_method = parser.parse_args().init_method
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        world_size=int(os.environ["WORLD_SIZE"]),
        rank=int(os.environ["RANK"]),
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    hot = torch.zeros(world, dtype=torch.int64)
    hot[rank] = 1
    dist.all_reduce(hot)
    if int(hot.sum()) != world:
        raise RuntimeError(f"all_reduce summed to {int(hot.sum())}, expected {world}")
    print(f"rank {rank}/{world} ok", flush=True)


if __name__ == "__main__":
    main()
