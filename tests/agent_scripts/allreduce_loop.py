"""A gloo job whose collectives fail when a peer dies (the usual way a node loss shows up)."""

import os
import sys
import time

import torch
import torch.distributed as dist

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 15
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
print(
    f"running rank {rank}/{world} round {os.environ['ETCDRUN_ROUND']} "
    f"restarts {os.environ['TORCHELASTIC_RESTART_COUNT']}",
    flush=True,
)
t = torch.ones(1)
for _ in range(steps):
    dist.all_reduce(t)
    time.sleep(0.2)
print(f"done rank {rank}/{world}", flush=True)
dist.destroy_process_group()
