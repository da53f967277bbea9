"""Worker runtime figures: start latency of N workers per entrypoint kind, the exec shim's cost,
and stop() latency. Prints figures; asserts nothing (see guide: no timing assertions in tests).

    python -m bench.bench_workers [--workers 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time

from etcdrun.agent.api import WorkerSpec
from etcdrun.agent.worker import boot as _boot
from etcdrun.agent.worker.group import WorkerGroup
from etcdrun.rendezvous.api import RendezvousInfo

READY = "import os,sys; open(os.path.join(sys.argv[1], 'ready_'+os.environ['RANK']),'w').close()"


def ready_fn(out: str) -> None:
    open(os.path.join(out, "ready_" + os.environ["RANK"]), "w").close()


def info(n: int) -> RendezvousInfo:
    return RendezvousInfo(
        run_id="bench",
        round=0,
        node_id="n",
        node_rank=0,
        node_count=1,
        first_global_rank=0,
        world_size=n,
        master_addr="127.0.0.1",
        master_port=1,
        restart_count=0,
    )


def start_to_ready(spec_kw: dict, n: int, out: str) -> tuple[float, float, float]:
    """(start() returned, all workers ran their first line, stop() of finished workers) in s."""
    for f in os.listdir(out):
        os.unlink(os.path.join(out, f))
    g = WorkerGroup(
        tempfile.mkdtemp(prefix="bench_"), console_out=io.BytesIO(), console_err=io.BytesIO()
    )
    t0 = time.perf_counter()
    g.start(WorkerSpec(local_world_size=n, **spec_kw), info(n))
    t_start = time.perf_counter() - t0
    while len(os.listdir(out)) < n:
        time.sleep(0.001)
    t_ready = time.perf_counter() - t0
    g.wait(60)
    t1 = time.perf_counter()
    g.stop()
    return t_start, t_ready, time.perf_counter() - t1


def median_ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1000:7.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="bench_out_")
    script = os.path.join(out + "_s.py")
    with open(script, "w") as fp:
        fp.write(READY + "\n")
    kinds = {
        "script": dict(entrypoint=script, args=(out,)),
        "executable (python -c)": dict(entrypoint=sys.executable, args=("-c", READY, out)),
        "callable spawn": dict(entrypoint=ready_fn, args=(out,), start_method="spawn"),
        "callable fork": dict(entrypoint=ready_fn, args=(out,), start_method="fork"),
    }
    print(f"{a.workers} workers, median of {a.repeat}: start() returns | all running | stop()")
    for name, kw in kinds.items():
        runs = [start_to_ready(kw, a.workers, out) for _ in range(a.repeat)]
        print(
            f"  {name:24s} {median_ms([r[0] for r in runs])} | "
            f"{median_ms([r[1] for r in runs])} | {median_ms([r[2] for r in runs])}"
        )
    direct, shimmed = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        subprocess.run(["/bin/true"], check=True)
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        subprocess.run(_boot.shim_argv(os.getpid(), ["/bin/true"]), check=True)
        shimmed.append(time.perf_counter() - t0)
    print(
        f"exec shim: /bin/true {median_ms(direct)}, through the shim {median_ms(shimmed)}"
        f" (cost {statistics.median(shimmed) * 1000 - statistics.median(direct) * 1000:.1f} ms"
        " per worker, paid in parallel)"
    )


if __name__ == "__main__":
    main()
