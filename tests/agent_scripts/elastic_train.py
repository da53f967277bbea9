"""A toy DDP job on ``etcdrun.elastic``: every rank trains on the same batches, so the averaged
gradient, and so the loss at every step, is that of one process (the tests compare them).

argv: OUT_DIR STEPS [STEP_SECONDS [HOLD_FILE]]. Each completed step appends one JSON line to
OUT_DIR/steps_<pid>.jsonl: step, rank, world, round, loss, time. With HOLD_FILE, the training
function returns only once that file exists (after its last step): a test makes the membership
change while the work is already done. With ``HANG_AT=R:S`` in the environment, rank R sleeps
at step S of the first round, inside the step, while its peers wait for it in DDP's all_reduce
(the hang watchdog's in-place test, tests/pytorch/test_hang.py). With ``COMMIT_EVERY=K``, the
state is committed every K steps instead of every step (the drain's test). With ``LINGER=S``,
the process stays S seconds after its training function returned, as a slow exit does.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from etcdrun import elastic

out, steps = sys.argv[1], int(sys.argv[2])
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
hold = sys.argv[4] if len(sys.argv) > 4 else None
hang_rank, _, hang_step = os.environ.get("HANG_AT", "-1:-1").partition(":")
every = int(os.environ.get("COMMIT_EVERY", "1"))

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.002)
state = elastic.TorchState(model=model, optimizer=opt, step=0)
log = open(os.path.join(out, f"steps_{os.getpid()}.jsonl"), "a", buffering=1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / (step % 7 + 1)
    return x, x.sum(1, keepdim=True) * 0.5


@elastic.run
def train(state: elastic.TorchState) -> None:
    while state.step < steps:
        x, y = batch(state.step)
        first_round = os.environ["ETCDRUN_ROUND"] == "1"
        if first_round and (dist.get_rank(), state.step) == (int(hang_rank), int(hang_step)):
            time.sleep(3600)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        line = {
            "step": state.step,
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "round": int(os.environ["ETCDRUN_ROUND"]),
            "loss": loss.item(),
            "t": time.time(),
        }
        log.write(json.dumps(line) + "\n")
        if state.step % every == 0:
            state.commit()
        time.sleep(pause)
    while hold is not None and not os.path.exists(hold):
        time.sleep(0.05)


train(state)
log.close()
time.sleep(float(os.environ.get("LINGER", "0")))
