"""The one toy DDP job that bench/in_place_compare.py trains under every launcher: the model,
its batches, the checkpoint every ``CKPT_EVERY`` steps, and the step log the figures come from.

Why one module: the issue asks for the same model, the same step time and the same checkpoint
interval in every column; the workers (bench/in_place_worker.py, bench/torchft_worker.py)
import this and differ only in how they survive a membership change.

Why a step log and not the launchers' logs: pause, work lost and recovery are read from when
each step *completed*, by the same clock (``time.time()``; every process runs on this machine)
and the same definitions for every launcher (bench/step_metrics.py). Each process appends
JSON lines to ``OUT/steps_<pid>.jsonl``: ``start`` (before ``import torch``), ``load`` (a
checkpoint was read, at which step), ``group`` and ``wrapped`` (the process group is up, the
DDP wrapper built), ``rewrap`` and ``sync`` (in place: the DDP wrapper rebuilt, the state
received; seconds, bytes) and ``step`` (step number completed, world size, rank).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STEP_S = 0.05  # the workers' sleep after each step
CKPT_EVERY = 20
WIDTH = 512  # the model: 256 -> 512 -> 1, 132k parameters; with SGD momentum ~1 MB of state
NODE_VAR = "BENCH_NODE"  # which node a worker runs on (the harness sets it per agent)


class StepLog:
    """Appends this process's records to ``OUT/steps_<pid>.jsonl`` (line-buffered)."""

    def __init__(self, out: str) -> None:
        self.node = os.environ.get(NODE_VAR, "?")
        path = Path(out) / f"steps_{os.getpid()}.jsonl"
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life

    def write(self, kind: str, **fields: object) -> None:
        rec = {"k": kind, "node": self.node, "pid": os.getpid(), "t": time.time(), **fields}
        self._f.write(json.dumps(rec) + "\n")


def build():
    """The model and optimizer, the same initial weights in every process."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1)
    )
    return net, torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)


def train_step(model, opt, step: int) -> float:
    """One step on the batch of ``step`` (the same batches whatever the world size)."""
    import torch

    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 256, generator=g)
    y = x[:, :1] * 0.5
    opt.zero_grad()  # first: torchft's wrapper starts its quorum here
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return loss.item()


def save_checkpoint(out: str, model, opt, step: int) -> None:
    """Write ``OUT/ckpt.pt`` atomically (a reader never sees half of one)."""
    import torch

    tmp = Path(out) / f"ckpt.{os.getpid()}.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, Path(out) / "ckpt.pt")


def load_checkpoint(out: str, model, opt) -> int:
    """The step of ``OUT/ckpt.pt`` once loaded into ``model``/``opt``; 0 when there is none."""
    import torch

    path = Path(out) / "ckpt.pt"
    if not path.exists():
        return 0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return int(saved["step"])
