"""An in-place chaos trial's worker (``etcdrun.elastic``); argv: <out dir> <steps> <step s>.

A small gloo DDP job that opts in: ``TorchState``, ``elastic.run`` and a ``commit()`` per step,
so its agent keeps it through a membership change instead of restarting it. It trains ``steps``
steps once the trial says ``go`` (every agent is in and every worker opted in), then exits 0.
Its ranks commit in step (one commit a step, none while they wait for the go): ``sync()`` takes
the state with the most commits, which is the newest only when every rank commits at the same
points.

What it leaves for the trial's checks, which cannot read a kept worker's round from /proc (its
environment there is the one it started with; ``elastic.run`` changes only ``os.environ``):

- ``start_<round>_<rank>_<pid>.json`` each time it enters a round (the first and every one it
  is handed), with its environment *then*: the rounds, ranks and recovery times, as
  chaos_worker.py's start files give them for restarted workers;
- ``held_<pid>.json``: the (RANK, round) it holds now, or none once it left a round (the
  training function raised: the round is over, its group released), with its process start
  time so that a reused pid is never taken for it (chaos_inplace.HeldSampler reads it);
- ``steps_<pid>.jsonl``: one line per step done (step, round), for the steps computed twice;
- ``done_<pid>.json`` once it trained to the end: a worker stopped after that (a round change
  while it exits) lost nothing, and is no failure to keep it.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from etcdrun import elastic

out, steps, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
PID = os.getpid()
with open(f"/proc/{PID}/stat") as fp:
    STARTED = fp.read().rsplit(")", 1)[1].split()[19]  # field 22, starttime


def _write(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as fp:
        json.dump(data, fp)
    os.replace(path + ".tmp", path)


def _hold(rank: int | None, rnd: int | None) -> None:
    _write(os.path.join(out, f"held_{PID}.json"), {"start": STARTED, "rank": rank, "round": rnd})


elastic.init_process_group("gloo")
net = torch.nn.Linear(4, 1)  # DDP gives every rank rank 0's parameters
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(net.parameters(), lr=2e-3)
state = elastic.TorchState(model=model, optimizer=opt, step=0)
log = open(os.path.join(out, f"steps_{PID}.jsonl"), "a", buffering=1)


def _enter() -> int:
    rank, rnd = dist.get_rank(), int(os.environ["ETCDRUN_ROUND"])
    _hold(rank, rnd)
    _write(
        os.path.join(out, f"start_{rnd}_{rank}_{PID}.json"),
        {"env": dict(os.environ), "pid": PID, "ppid": os.getppid(), "t": time.time()},
    )
    return rnd


@elastic.run
def train(state: elastic.TorchState) -> None:
    try:
        rnd = _enter()
        go = torch.zeros(1)
        while not go.item():  # in step: a round that ends before the go fails this collective
            go.fill_(float(os.path.exists(os.path.join(out, "go"))))
            dist.all_reduce(go, op=dist.ReduceOp.MAX)
            time.sleep(0.05)
        x = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        while state.step < steps:
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.step += 1
            log.write(json.dumps({"step": state.step, "round": rnd, "t": time.time()}) + "\n")
            state.commit()
            time.sleep(pause)
    except BaseException:
        _hold(None, None)  # out of the round before elastic.run forms the next one
        raise


train(state)
log.close()
_write(os.path.join(out, f"done_{PID}.json"), {"t": time.time()})  # trained to the end
