"""The torchft 0.2.0 worker of bench/in_place_compare.py; argv: OUT_DIR LIGHTHOUSE TIMEOUT_S.

One process is one torchft replica group of one rank (a "node"), as each etcdrun agent here
runs one worker: its own TCPStore, a ``Manager`` that joins the Lighthouse, torchft's
``ProcessGroupGloo``, ``DistributedDataParallel`` and ``Optimizer`` wrappers, as torchft's own
train_ddp example does. A step counts once the Manager committed it (``should_commit``); a
newcomer heals from a peer (torchft's checkpoint transport), never from ``ckpt.pt``, which
replica rank 0 writes every ``CKPT_EVERY`` steps as the other columns do.

``TIMEOUT_S``: the Manager's and the process group's timeout (collectives, commit, healing):
torchft's default is 60 s; "tuned" gives it the lease's 2 s, as a frozen peer is noticed only
by it.
"""

import datetime
import os
import sys
import time

from toy_job import CKPT_EVERY, STEP_S, StepLog, build, save_checkpoint, train_step

_T0 = time.time()
OUT, LIGHTHOUSE, TIMEOUT_S = sys.argv[1], sys.argv[2], float(sys.argv[3])
LOG = StepLog(OUT)
LOG.write("start", t=_T0)

import torch  # noqa: E402
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: E402


def main() -> None:
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    net, opt = build()

    def load_state_dict(sd) -> None:
        net.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=2,
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": net.state_dict(), "opt": opt.state_dict()},
        replica_id=os.environ.get("BENCH_NODE", "node0"),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=LIGHTHOUSE,
        timeout=timeout,
    )
    ddp = DistributedDataParallel(manager, net)
    ft_opt = Optimizer(manager, opt)
    deadline = time.monotonic() + 600  # never outlive a forgotten harness for long
    while time.monotonic() < deadline:
        before = manager.current_step()
        train_step(ddp, ft_opt, before)  # zero_grad starts the quorum; step() commits or not
        step = manager.current_step()
        if step > before:
            rank = manager.participating_rank()
            LOG.write("step", s=step, w=manager.num_participants(), r=rank)
            if step % CKPT_EVERY == 0 and rank == 0:
                save_checkpoint(OUT, net, opt, step)
        time.sleep(STEP_S)


if __name__ == "__main__":
    main()
