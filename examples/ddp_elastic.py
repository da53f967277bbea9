"""An elastic PyTorch DDP training job (gloo, CPU) that survives being killed and rescaled.

Why this shape: an elastic launcher (etcdrun, torchrun) restarts *every* worker whenever the
membership changes or a worker fails, so a job that keeps its progress must store it outside the
workers and pick it up on start. This is the standard pattern, with nothing launcher-specific in
it: only torchrun's environment is read (RANK, WORLD_SIZE, MASTER_ADDR/PORT through
``init_process_group``, TORCHELASTIC_RESTART_COUNT; LOCAL_RANK would pick a GPU, and there is
none here), so it runs unmodified under both.

- Checkpoints: every ``--checkpoint-every`` steps (and after the last), rank 0 writes model,
  optimizer and step to ``ckpt_<step>.pt.tmp``, fsyncs it, ``os.replace``s it to
  ``ckpt_<step>.pt`` and fsyncs the directory: a reader sees a whole checkpoint or none, even if
  the writer is killed halfway.
- Resume: on start, rank 0 picks the newest checkpoint and broadcasts its step; every rank loads
  that one file (model *and* optimizer: SGD's momentum is part of the trajectory), so the ranks
  agree even if the directory changes while they start.
- Data per global step, not per rank: step s trains on batch s, drawn from a generator seeded
  by (seed, s), and rank r takes the r-th slice of it. The loss is scaled so that DDP's average
  of the ranks' gradients is the full batch's gradient. So the run repeats no step beyond the
  last checkpoint, loses none, and follows the same loss curve whatever the world size (equal to
  a one-process run's to float rounding: tests/pytorch/test_ddp_elastic.py checks it within 1e-4
  at world sizes 2, 3 and 4; what it sees: bench/results/by_hand.md, 'Other measurements').

Rank 0 prints one line per step, ``ddp_elastic step=<s> world=<W> loss=<mean over the batch>``,
plus ``resume``, ``checkpoint`` and ``done`` lines in the same ``key=value`` form.

``--in-place`` (etcdrun only; docs/in-place.md): the loop runs in ``etcdrun.elastic.run`` with a
``TorchState``, committed after every step. A membership change then keeps the survivors'
processes: they go back to the last commit, re-form the group for the new world and train on,
printing ``regroup step=<s> world=<W>``; a newcomer takes the survivors' state, and no
checkpoint is read. The checkpoints are still written (a restart of every worker, after a
failure of the script's own, resumes from them, as without ``--in-place``).
``--fail-rank/--fail-at-step`` make one rank raise, to exercise the launcher's restart budget;
``--fail-attempts`` limits it to the first N attempts (by TORCHELASTIC_RESTART_COUNT).

What a step and a worker's start (Python, ``import torch``, the gloo init) take on a small CPU
machine: bench/results/by_hand.md, 'Other measurements', and bench/results/figures.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

CKPT = re.compile(r"^ckpt_(\d{8})\.pt$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps (default 100)")
    p.add_argument("--checkpoint-dir", type=Path, required=True, help="shared by every node")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (0: all; default 3)")
    p.add_argument("--batch", type=int, default=240, help="global batch size (default 240)")
    p.add_argument("--hidden", type=int, default=512, help="hidden width (default 512)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--in-place", action="store_true", help="keep the processes through a membership change"
    )
    p.add_argument("--fail-rank", type=int, default=None, help="this RANK raises ...")
    p.add_argument("--fail-at-step", type=int, default=None, help="... at this step ...")
    p.add_argument(
        "--fail-attempts",
        type=int,
        default=1,
        help="... while TORCHELASTIC_RESTART_COUNT < this (default 1: the first attempt only)",
    )
    args = p.parse_args(argv)
    if args.steps < 0 or args.checkpoint_every < 1 or args.batch < 1 or args.keep < 0:
        p.error("--steps >= 0, --checkpoint-every >= 1, --batch >= 1 and --keep >= 0")
    if (args.fail_rank is None) != (args.fail_at_step is None):
        p.error("--fail-rank and --fail-at-step go together")
    return args


FEATURES = 32


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every run
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, args.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(args.hidden, 1),
    )


def batch_for(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: a function of (seed, step) alone, never of the rank, the
    world size or how many steps this process has run, so a resumed run sees what it would have
    seen.
    """
    teacher = torch.Generator().manual_seed(args.seed + 7)
    w = torch.randn(FEATURES, 1, generator=teacher) / FEATURES**0.5
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.batch, FEATURES, generator=gen)
    y = torch.sin(x @ w) + 0.05 * torch.randn(args.batch, 1, generator=gen)
    return x, y


def config_of(args: argparse.Namespace) -> dict[str, object]:
    """What a checkpoint must match to be resumed (a different model or data is another job)."""
    return {"hidden": args.hidden, "batch": args.batch, "seed": args.seed, "lr": args.lr}


def checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Whole checkpoints in ``directory``, newest first (a ``.tmp`` is never one)."""
    found = []
    for path in directory.iterdir():
        m = CKPT.match(path.name)
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found, reverse=True)


def save(directory: Path, step: int, model: torch.nn.Module, opt, args, keep: int) -> Path:
    """Write the checkpoint of ``step`` atomically, then drop all but the ``keep`` newest."""
    final = directory / f"ckpt_{step:08d}.pt"
    tmp = directory / f"{final.name}.tmp.{os.getpid()}"
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "config": config_of(args),
        "world_size": dist.get_world_size(),
    }
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash of the machine
    finally:
        os.close(fd)
    if keep:
        for _, old in checkpoints(directory)[keep:]:
            old.unlink(missing_ok=True)
    return final


def latest_step(directory: Path) -> int:
    """Rank 0's choice: the newest checkpoint's step, 0 when there is none."""
    found = checkpoints(directory)
    return found[0][0] if found else 0


def load(directory: Path, step: int, model: torch.nn.Module, opt, args) -> None:
    state = torch.load(directory / f"ckpt_{step:08d}.pt", weights_only=True)
    if state["config"] != config_of(args):
        sys.exit(
            f"ddp_elastic: {directory} holds a checkpoint of another job "
            f"({state['config']} != {config_of(args)}); use another --checkpoint-dir"
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def agreed_start(directory: Path) -> int:
    """The step every rank resumes from: rank 0's pick, broadcast."""
    step = torch.tensor([latest_step(directory) if dist.get_rank() == 0 else 0])
    dist.broadcast(step, src=0)
    return int(step.item())


def train_step(step: int, model, opt, args) -> float:
    """One optimizer step on this rank's slice of batch ``step``; the batch's mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch_for(step, args)
    xs, ys = torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]
    opt.zero_grad(set_to_none=True)
    # DDP averages the ranks' gradients: scaling each rank's sum by world/batch makes that
    # average the gradient of the whole batch's mean, whatever the slices' sizes.
    err = torch.nn.functional.mse_loss(model(xs), ys, reduction="sum")
    (err * (world / args.batch)).backward()
    opt.step()
    total = err.detach().reshape(1)
    dist.all_reduce(total)
    return total.item() / args.batch


def maybe_fail(step: int, args: argparse.Namespace) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if step == args.fail_at_step and dist.get_rank() == args.fail_rank:
        if attempt < args.fail_attempts:
            raise RuntimeError(f"injected failure at step {step} on rank {args.fail_rank}")


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(f"ddp_elastic {text}", flush=True)


def resume_line(start: int) -> str:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    world = dist.get_world_size()
    return (
        f"resume step={start} world={world} restart={restart} master={master} t={time.time():.3f}"
    )


def train_in_place(model, opt, args: argparse.Namespace) -> None:
    """The same steps in ``etcdrun.elastic.run``: only a fresh start reads a checkpoint."""
    from etcdrun import elastic

    state = elastic.TorchState(model=model, optimizer=opt, step=0)
    state.on_reset(
        lambda: say(f"regroup step={state.step} world={dist.get_world_size()} t={time.time():.3f}")
    )

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        if state.step == 0:  # every worker fresh (the job's start, a restart): the checkpoint
            start = agreed_start(args.checkpoint_dir)
            if start:
                load(args.checkpoint_dir, start, model.module, opt, args)
            state.step = start
            say(resume_line(start))
        while state.step < args.steps:
            step, world = state.step + 1, dist.get_world_size()
            maybe_fail(step, args)
            loss = train_step(step, model, opt, args)
            say(f"step={step} world={world} loss={loss:.9g}")
            if step % args.checkpoint_every == 0 or step == args.steps:
                if dist.get_rank() == 0:
                    save(args.checkpoint_dir, step, model.module, opt, args, args.keep)
                say(f"checkpoint step={step}")
            state.step = step
            state.commit()
        say(f"done steps={args.steps} world={dist.get_world_size()} t={time.time():.3f}")

    train(state)


@record  # torchrun's error file: the launcher reports this rank's exception as the root cause
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if args.in_place:  # etcdrun forms the group, so that it can release it (docs/in-place.md)
        from etcdrun import elastic

        elastic.init_process_group("gloo")
    else:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    model = DistributedDataParallel(make_model(args))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.in_place:
        train_in_place(model, opt, args)
        dist.destroy_process_group()
        return
    start = agreed_start(args.checkpoint_dir)
    if start:
        load(args.checkpoint_dir, start, model.module, opt, args)
    say(resume_line(start))
    for step in range(start + 1, args.steps + 1):
        maybe_fail(step, args)
        loss = train_step(step, model, opt, args)
        say(f"step={step} world={world} loss={loss:.9g}")
        if step % args.checkpoint_every == 0 or step == args.steps:
            if dist.get_rank() == 0:
                save(args.checkpoint_dir, step, model.module, opt, args, args.keep)
            say(f"checkpoint step={step}")
    say(f"done steps={args.steps} world={world} t={time.time():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
