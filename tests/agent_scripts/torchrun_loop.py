"""A gloo all_reduce loop for plain torchrun: only torchrun's environment, nothing of etcdrun.

Each worker prints one line when its process group is up (rank, world, node rank, restart
count, master) and one when it is done; a peer's death makes its all_reduce fail, which is how
torchrun learns of it when the rendezvous has not told it first.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 15
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
env = os.environ
print(
    f"running rank {rank}/{world} node {env['GROUP_RANK']}/{env['GROUP_WORLD_SIZE']} "
    f"restarts {env['TORCHELASTIC_RESTART_COUNT']} master {env['MASTER_ADDR']}:"
    f"{env['MASTER_PORT']} agent_store {env['TORCHELASTIC_USE_AGENT_STORE']}",
    flush=True,
)
t = torch.ones(1)
for _ in range(steps):
    dist.all_reduce(t)
    time.sleep(0.2)
print(f"done rank {rank}/{world} sum {t.item():g}", flush=True)
dist.destroy_process_group()
# Run by plain torchrun (the plugin test), whose script workers torch 2.13 + gloo still abort at
# exit now and then (9-15 of 50, bench/clean_exit.py): etcdrun's exit fix is not in them.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
