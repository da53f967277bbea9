"""The worker of bench/in_place_compare.py under etcdrun and torchrun; argv: MODE OUT_DIR.

``restart``: what every script does today. At start it reads the last checkpoint (every
``CKPT_EVERY`` steps, written by rank 0), so a membership change costs the steps since it.
``inplace``: the same loop inside ``etcdrun.elastic.run``, a commit after every step; it writes
the same checkpoints (their cost is in both columns) and never reads one.

The training never ends by itself: the harness reads the step log and kills the job.
"""

import datetime
import sys
import time

from toy_job import CKPT_EVERY, STEP_S, StepLog, build, load_checkpoint, save_checkpoint, train_step

_T0 = time.time()
MODE, OUT = sys.argv[1], sys.argv[2]
LOG = StepLog(OUT)
LOG.write("start", t=_T0)

import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

DEADLINE = time.monotonic() + 600  # never outlive a forgotten harness for long


def _step_done(model, opt, step: int) -> None:
    LOG.write("step", s=step, w=dist.get_world_size(), r=dist.get_rank())
    if step % CKPT_EVERY == 0 and dist.get_rank() == 0:
        save_checkpoint(OUT, model, opt, step)
    time.sleep(STEP_S)


def restart(net, ddp, opt) -> None:
    step = load_checkpoint(OUT, net, opt)
    LOG.write("load", s=step)
    while time.monotonic() < DEADLINE:
        train_step(ddp, opt, step)
        step += 1
        _step_done(net, opt, step)


def in_place(net, ddp, opt) -> None:
    from etcdrun import elastic

    class TimedState(elastic.TorchState):
        """Logs each state transfer (bytes, seconds: the scale-up's MB/s) and each DDP re-wrap
        (seconds): with the agent's ``form_s`` they say where a re-form's time goes.
        """

        def rewrap(self) -> None:
            t = time.perf_counter()
            super().rewrap()
            LOG.write("rewrap", secs=time.perf_counter() - t)

        def sync(self) -> int:
            t = time.perf_counter()
            n = super().sync()
            LOG.write("sync", bytes=n, secs=time.perf_counter() - t)
            return n

    state = TimedState(model=ddp, optimizer=opt, step=0)

    @elastic.run
    def train(state) -> None:
        while time.monotonic() < DEADLINE:
            train_step(ddp, opt, state.step)
            state.step += 1
            _step_done(net, opt, state.step)
            state.commit()

    train(state)


def main() -> None:
    if MODE == "inplace":  # etcdrun's group, which its release can end (docs/in-place.md)
        from etcdrun import elastic

        elastic.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    LOG.write("group")  # where a newcomer's time goes before its first step
    net, opt = build()
    ddp = DistributedDataParallel(net)
    LOG.write("wrapped")
    (in_place if MODE == "inplace" else restart)(net, ddp, opt)


if __name__ == "__main__":
    main()
