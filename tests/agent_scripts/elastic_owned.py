"""An in-place job as a real one is written: ``elastic.init_process_group``, DDP, a OneCycleLR
schedule, an ``ElasticSampler`` over a dataset, and a TCP connection of the script's own.

argv: OUT_DIR STEPS STEP_SECONDS. Environment: ``INIT=elastic|dist`` (who forms the first
group), ``ECHO=host:port`` (an echo server: the script connects before it forms its group and
sends one line over that same connection at the first step of every round, expecting it back).

Each completed step appends one JSON line to OUT_DIR/steps_<pid>.jsonl: step, rank, world, round,
lr (the rate the step trained at), samples (the indices of this rank's batch), echo (the line
came back, at a round's first step), numpy (whether ``import numpy`` works here).
"""

import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from etcdrun import elastic

out, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
BATCH, LENGTH = 4, 4096

host, _, port = os.environ["ECHO"].partition(":")
own = socket.create_connection((host, int(port)))  # the script's: etcdrun must never shut it
reader = own.makefile("rb")

try:
    import numpy  # noqa: F401

    has_numpy = True
except ImportError:
    has_numpy = False

if os.environ.get("INIT", "elastic") == "elastic":
    elastic.init_process_group("gloo")
else:
    dist.init_process_group("gloo")
torch.manual_seed(0)
data = torch.arange(LENGTH * 4, dtype=torch.float32).reshape(LENGTH, 4) / LENGTH
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps)
sampler = elastic.ElasticSampler(LENGTH, shuffle=True, seed=7)
state = elastic.TorchState(model=model, optimizer=opt, scheduler=sched, sampler=sampler, step=0)
log = open(os.path.join(out, f"steps_{os.getpid()}.jsonl"), "a", buffering=1)
echoed: set[int] = set()


def echo(round_: int) -> bool:
    own.sendall(f"ping {os.getpid()} {round_}\n".encode())
    return reader.readline().decode().strip() == f"ping {os.getpid()} {round_}"


@elastic.run
def train(state: elastic.TorchState) -> None:
    batches = iter(torch.utils.data.DataLoader(range(LENGTH), batch_size=BATCH, sampler=sampler))
    while state.step < steps:
        idx = next(batches)
        x = data[idx]
        lr = opt.param_groups[0]["lr"]
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        sampler.record_batch(BATCH)
        state.step += 1
        round_ = int(os.environ["ETCDRUN_ROUND"])
        line = {
            "step": state.step,
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "round": round_,
            "lr": lr,
            "samples": idx.tolist(),
            "numpy": has_numpy,
        }
        if round_ not in echoed:
            line["echo"] = echo(round_)
            echoed.add(round_)
        log.write(json.dumps(line) + "\n")
        state.commit()
        time.sleep(pause)


train(state)
log.close()
own.close()
