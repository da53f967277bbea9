"""One rank of bench/release_stress.py; argv: RANK WORLD PORT SEED ROUNDS BARRIER_DIR HOOK.

Each round it trains a small gloo DDP model (``etcdrun.elastic.group.Group`` forms the group,
as ``elastic.init_process_group`` and ``elastic.run`` do) until a timer releases the group at
a moment drawn from the seed, each rank a few milliseconds apart, as agents that learn of a
round change from etcd at slightly different times. With HOOK=1 the model's all-reduces go
through ``InFlight`` (what ``elastic.run`` does); with 0 through DDP's own, which the release
cannot end when gloo keeps a send pending. It prints one JSON line per round it left, then DONE.
"""

import json
import os
import random
import sys
import threading
import time

import torch

from etcdrun.elastic.group import Group

rank, world, port, seed, rounds = (int(a) for a in sys.argv[1:6])
barrier, hooked = sys.argv[6], sys.argv[7] == "1"
os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
net = torch.nn.Linear(4, 1)
x = torch.arange(32, dtype=torch.float32).reshape(8, 4)
group = Group()


def _meet(k: int) -> None:
    """Every rank has left round ``k``: the next group's ports are then free of the old one."""
    open(os.path.join(barrier, f"{k}_{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(barrier, f"{k}_{r}")) for r in range(world)):
        time.sleep(0.01)


for k in range(rounds):
    os.environ["MASTER_PORT"] = str(port + k)
    if k > 0:
        held = group.held.collectives
        group.drop()
        if group.held.collectives > held:  # Group counts it (Held); release_stress.py reads this
            print("a collective of the round before is still inside gloo", flush=True)
    group.form("gloo")  # the first too: elastic.init_process_group's, which a release can end
    group.check_round()
    model = torch.nn.parallel.DistributedDataParallel(net)
    if hooked:
        group.inflight.hook(model)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    at = random.Random(seed * 1000 + k).uniform(0.3, 0.7)  # the same on every rank
    at += random.Random(seed * 1000 + k * 10 + rank).uniform(0, 0.06)
    released = threading.Event()

    def release(done: threading.Event = released) -> None:
        group.release()
        done.set()

    began = time.monotonic()
    threading.Timer(at, release).start()
    steps, how = 0, "flag"
    try:
        while not released.is_set():
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            time.sleep(0.05)
    except Exception as e:  # the released group's collective failed, as it should
        how = type(e).__name__
        released.wait()
    left = time.monotonic() - began - at
    print(json.dumps({"rank": rank, "round": k, "steps": steps, "how": how, "left_s": left}))
    sys.stdout.flush()
    _meet(k)
print("DONE", flush=True)
