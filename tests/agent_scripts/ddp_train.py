"""An ordinary PyTorch DDP training script, as a user writes it for torchrun: nothing in it
knows about etcdrun. gloo on the CPU; the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
is all it gets from the launcher.

Rank 0 prints the final loss; every rank prints a checksum of its parameters, so a test can see
that DDP kept the replicas identical (gradients were really all-reduced across nodes).
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial model everywhere (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of data
    x = torch.randn(64, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True)

    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # 1 + 2 + ... + world
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(f"rank {rank}/{world} all_reduce {total.item():g} params {checksum:.10f}", flush=True)
    if rank == 0:
        print(f"final loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
