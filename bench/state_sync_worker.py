"""The measured processes of bench/state_sync.py: ``python -m bench.state_sync_worker SPEC``.

Why a module of its own: each case of the bench runs in fresh processes, and this is all that
runs in them: the state they build (a transformer-shaped module and its Adam state, of a size
asked for), the memory meter, and one function per kind of case (a commit against a deep copy;
one rank of a ``sync()``; one rank of torchft's transport). SPEC is a JSON object (its
``kind`` picks the function); the result is one JSON line on stdout, after ``RESULT ``.
torchft's worker runs under torchft's venv, so nothing here is imported before it is needed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

MB = 1 << 20
LAYERS = 8  # blocks of the model: each 4 Linear and 2 LayerNorm
TIMEOUT_S = 300  # a case's limit, and torchft's timeouts; a 1 GB case takes well under it
PREFIX = "RESULT "


# ---- the state ---------------------------------------------------------------------------------
def build(target_bytes: int, seed: int) -> tuple[Any, Any]:
    """A transformer-shaped module and its Adam optimizer after one step, whose state (weights
    and both moments, float32) is about ``target_bytes``: an embedding and an output head of
    16·d² each, ``LAYERS`` blocks of 12·d² in 4 weights and 10 small vectors, and per parameter
    Adam's two moments and its step (a scalar tensor).
    """
    import torch
    from torch import nn

    d = max(16, int((target_bytes / 12 / 128) ** 0.5) // 16 * 16)
    torch.manual_seed(seed)
    blocks = [
        nn.Sequential(
            nn.LayerNorm(d),
            nn.Linear(d, 3 * d),
            nn.Linear(d, d),
            nn.LayerNorm(d),
            nn.Linear(d, 4 * d),
            nn.Linear(4 * d, d),
        )
        for _ in range(LAYERS)
    ]
    head = [nn.LayerNorm(d), nn.Linear(d, 16 * d, bias=False)]
    model = nn.Sequential(nn.Embedding(16 * d, d), *blocks, *head)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3 * (seed + 1))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _tensor_count(model: Any, opt: Any) -> int:
    from etcdrun.elastic.snapshot import flatten

    return len(flatten({"model": model.state_dict(), "opt": opt.state_dict()})[1])


# ---- memory ------------------------------------------------------------------------------------
def read_kb(path: str, field: str) -> int:
    """A ``field:  N kB`` line of a /proc file (status, meminfo): N."""
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in {path}")


def _status_kb(field: str) -> int:
    return read_kb("/proc/self/status", field)


class Peak:
    """This process's peak RSS above a base: the kernel's VmHWM, reset through clear_refs, or a
    sampling thread where the reset is refused. ``start()`` hands the allocator's free memory
    back to the system (glibc's ``malloc_trim``: what an earlier call freed would hide what the
    next one needs, since a first call in a fresh process finds none) and sets the base (VmRSS
    now); ``extra()`` is the peak since the last ``start()`` or ``extra()``, minus the base, in
    bytes.
    """

    def __init__(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "sampled VmRSS (1 ms)"
            self._high = 0
            threading.Thread(target=self._sample, daemon=True).start()
        self.base = 0

    def _sample(self) -> None:
        while True:
            self._high = max(self._high, _status_kb("VmRSS"))
            time.sleep(0.001)

    def reset(self) -> None:
        if self.method == "VmHWM":
            Path("/proc/self/clear_refs").write_text("5")
        else:
            self._high = _status_kb("VmRSS")

    def start(self) -> None:
        _trim()
        self.reset()
        self.base = _status_kb("VmRSS") * 1024

    def extra(self) -> int:
        high = _status_kb("VmHWM") if self.method == "VmHWM" else self._high
        self.reset()
        return max(0, high * 1024 - self.base)


def _trim() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass


# ---- workers (one process each) ----------------------------------------------------------------
def commit_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Commit against deep copy, in one process holding one state."""
    import copy

    from etcdrun.elastic import TorchState

    model, opt = build(spec["bytes"], 0)
    peak = Peak()
    peak.start()
    t = time.perf_counter()
    state = TorchState(model=model, optimizer=opt)  # the first commit: its buffers allocated
    first, first_extra = time.perf_counter() - t, peak.extra()
    out: dict[str, Any] = {"commit_s": [], "commit_extra": [], "deep_s": [], "deep_extra": []}
    for _ in range(spec["reps"]):
        peak.start()
        t = time.perf_counter()
        state.commit()
        out["commit_s"].append(time.perf_counter() - t)
        out["commit_extra"].append(peak.extra())
        peak.start()
        t = time.perf_counter()
        old = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        out["deep_s"].append(time.perf_counter() - t)
        out["deep_extra"].append(peak.extra())
        del old
    out.update(bytes=state.committed_bytes, tensors=_tensor_count(model, opt))
    out.update(first_s=first, first_extra=first_extra, memory=peak.method)
    return out


class Phases:
    """``sync()``'s phases, timed and peak-measured from inside: the bench wraps
    ``stream.broadcast`` and ``agree.check`` (state.py calls them through their modules), so
    the gather of the commit counts comes before the broadcast, the restore of the live objects
    between it and the agreement check.
    """

    def __init__(self, peak: Peak) -> None:
        self.peak = peak
        self.times: dict[str, float] = {}
        self.extra: dict[str, int] = {}
        self._last = 0.0

    def begin(self) -> None:
        self.times, self.extra = {}, {}
        self.peak.start()
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.times[phase] = now - self._last
        self.extra[phase] = self.peak.extra()
        self._last = now

    def wrap(self, before: str, after: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.mark(before)
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(after)

        return wrapped


def sync_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of a gloo group: commit, the source once more, then ``sync()`` per rep."""
    import torch.distributed as dist

    from etcdrun.elastic import TorchState, agree, stream

    rank, world, src = spec["rank"], spec["world"], spec["world"] - 1
    url = f"tcp://127.0.0.1:{spec['port']}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world)
    model, opt = build(spec["bytes"], rank)
    state = TorchState(model=model, optimizer=opt)
    state.commit()
    phases = Phases(Peak())
    stream.BUCKET_BYTES = spec["bucket"]
    stream.broadcast = phases.wrap("gather", "broadcast", stream.broadcast)
    agree.check = phases.wrap("load", "agree", agree.check)
    runs = []
    for _ in range(spec["reps"]):
        if rank == src:
            state.commit()  # the newest commit: every other rank takes this one
        mine = [t.data_ptr() for t in state._shared_copy.reusable()]  # noqa: SLF001 (a bench)
        dist.barrier()
        phases.begin()
        t = time.perf_counter()
        sent = state.sync()
        total = time.perf_counter() - t
        got = [t.data_ptr() for t in state._shared_copy.reusable()]  # noqa: SLF001
        runs.append(
            {"total_s": total, "sent": sent, "times": phases.times, "extra": phases.extra}
            | {"reused": mine == got, "commits": state.commits}
        )
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "source": rank == src, "runs": runs, "memory": phases.peak.method}


def torchft_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of torchft's transport: the last rank sends the state_dict, the others
    receive it and load it as torchft's Manager does (``load_state_dict`` of each object).
    """
    from datetime import timedelta
    from importlib.metadata import version

    import torch
    import torch.distributed as dist
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.process_group import ProcessGroupGloo

    rank, world, kind, src = spec["rank"], spec["world"], spec["transport"], spec["world"] - 1
    timeout = timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", spec["port"], world, rank == 0, timeout, False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("bench", store), rank=rank, world_size=world
    )
    model, opt = build(spec["bytes"], rank)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    if kind == "http":
        transport: Any = HTTPTransport(timeout, num_chunks=0)
    else:
        pg = ProcessGroupGloo(timeout=timeout)
        pg.configure(f"127.0.0.1:{spec['port']}/torchft", "bench", rank, world)
        inplace = state_dict if kind == "pg-inplace" else None
        transport = PGTransport(pg, timeout, torch.device("cpu"), state_dict=inplace)
    others, peak, runs = [r for r in range(world) if r != src], Peak(), []
    for step in range(spec["reps"]):
        if rank == src and kind == "http":  # the server holds it; receivers fetch
            transport.send_checkpoint(others, step, state_dict(), timeout)
            store.set(f"addr{step}", transport.metadata())
        peak.start()
        dist.barrier()
        t = time.perf_counter()
        if rank == src and kind != "http":
            transport.send_checkpoint(others, step, state_dict(), timeout)
        if rank != src:
            where = store.get(f"addr{step}").decode() if kind == "http" else transport.metadata()
            got = transport.recv_checkpoint(src, where, step, timeout)
        moved = time.perf_counter() - t
        if rank != src:
            model.load_state_dict(got["model"])
            opt.load_state_dict(got["opt"])
            del got
        loaded = time.perf_counter() - t - moved
        dist.barrier()  # the source's peak includes serving the receivers
        runs.append({"transport_s": moved, "load_s": loaded, "extra": peak.extra()})
    if kind == "http":
        transport.shutdown()
    dist.destroy_process_group()
    sent = sum(t.numel() * t.element_size() for t in _tensors(state_dict()))
    out = {"rank": rank, "source": rank == src, "runs": runs, "sent": sent}
    return out | {"memory": peak.method, "torchft": version("torchft"), "torch": torch.__version__}


def _tensors(tree: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


WORKERS = {"commit": commit_worker, "sync": sync_worker, "torchft": torchft_worker}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    print(PREFIX + json.dumps(WORKERS[spec["kind"]](spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
