"""What every rank has, whatever its case: its log, its model, and the driver's notices.

The log: ``begin`` points the process's stdout and stderr at its own file, and ``emit`` writes
one JSON line per event (``{"ev": ..., "who": ..., "t": time.monotonic()}``: one clock for
every process of the machine, so the driver can subtract one rank's times from another's).
faulthandler writes the Python stacks there on SIGUSR1, for the driver to read where a hung
rank is. The model is a tiny DDP on the round's group: its constructor broadcasts and its
backward all-reduces, so training is a stream of collectives for a release to cut; it is made
in the rank, never in the forkserver. The notices and ``meet`` go through files in the launch's
directory: after a release, the group is the one thing the ranks must not rely on.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo  # noqa: F401 - DDP's first construction imports it: seconds, in the forkserver

from bench.reform.paths import HOST, Fresh, Reconf

WHO = "?"
NET: Any = None  # the model and its data: made in the rank (begin), not in the forkserver
X: Any = None


def begin(spec: dict[str, Any]) -> None:
    """The rank's log (stdout and stderr), its stacks on SIGUSR1, its name, model and data."""
    global WHO, NET, X
    sys.stdout.flush()
    fd = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    WHO = spec["who"]
    os.environ["MASTER_ADDR"] = HOST
    torch.set_num_threads(1)
    NET = torch.nn.Linear(4, 1)
    X = torch.arange(32, dtype=torch.float32).reshape(8, 4)


def emit(ev: str, **kv: Any) -> None:
    """One JSON line to the log: a single write, so that threads never interleave lines."""
    kv.setdefault("t", time.monotonic())
    os.write(1, (json.dumps({"ev": ev, "who": WHO, **kv}) + "\n").encode())


def error(e: BaseException) -> dict[str, Any]:
    msg = str(e).strip().splitlines()
    return {"type": type(e).__name__, "msg": (msg[0] if msg else "")[:200]}


def wrap(path: Fresh | Reconf, hook: bool) -> tuple[Any, Any]:
    """A new DDP wrapper on the round's group (its constructor broadcasts: a collective)."""
    model = torch.nn.parallel.DistributedDataParallel(NET)
    if hook:
        path.inflight.hook(model)
    return model, torch.optim.SGD(NET.parameters(), lr=1e-3)


def step(model: Any, opt: Any) -> None:
    loss = ((model(X) - X.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def train(model: Any, opt: Any, stop: Callable[[], bool]) -> tuple[int, str]:
    """Steps until ``stop()`` or a collective fails: (steps, "flag" or the error's class)."""
    steps = 0
    try:
        while not stop():
            step(model, opt)
            steps += 1
            time.sleep(0.05)
    except Exception as e:  # the released group's collective failed, as it should
        return steps, type(e).__name__
    return steps, "flag"


def train_round(path: Fresh | Reconf, d: str, name: str) -> tuple[str, float]:
    """A new DDP wrapper, then steps until the driver's notice ``name``, which a thread of its
    own turns into the path's release at once (as etcdrun's link does): (how the training
    ended, the release's time).
    """
    released, at = threading.Event(), []

    def watch() -> None:
        await_notice(d, name, within=600)
        at.append(time.monotonic())
        path.release()
        released.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        model, opt = wrap(path, True)
        emit("training")
        how = train(model, opt, released.is_set)[1]
    except Exception as e:  # a peer died while DDP broadcast its parameters
        how = type(e).__name__
    released.wait()
    return how, at[0]


def notice(d: str, name: str) -> float | None:
    """The driver's notice ``name`` (its time), or None before it is written."""
    try:
        with open(os.path.join(d, f"notice_{name}")) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def await_notice(d: str, name: str, within: float = 60.0) -> float:
    end = time.monotonic() + within
    while (t := notice(d, name)) is None:
        if time.monotonic() > end:
            raise TimeoutError(f"no notice {name}")
        time.sleep(0.002)
    return t


def meet(d: str, tag: str, rank: int, ranks: range) -> None:
    """Every rank of ``ranks`` got here (files: the barrier must not use the released group)."""
    open(os.path.join(d, f"meet_{tag}_{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(d, f"meet_{tag}_{r}")) for r in ranks):
        time.sleep(0.002)
