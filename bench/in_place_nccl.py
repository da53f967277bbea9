#!/usr/bin/env python3
"""In place on a GPU with NCCL: ``python -m bench.in_place_nccl --backend nccl``.

Why: every in-place figure so far (bench/in_place_compare.py, the tests) is gloo on the CPU,
and NCCL takes other paths (the communicator's abort instead of shut sockets, the state's sync
through a device bucket). This runs the two in-place scenarios, a node killed (-9, not rank 0)
and a newcomer arriving, with a small DDP model on ``elastic.init_process_group(BACKEND)``,
``TorchState`` and a ``commit()`` every step (bench/in_place_nccl_worker.py), on a real local
etcd and real local agents, one GPU per agent (``CUDA_VISIBLE_DEVICES``; ``--gpus N``: N
agents, by default every GPU up to 3). Per scenario: whether the survivors kept their
processes, steps lost, the pause (the workers' own step times), every step's loss against one
process's, the newcomer's first step, and each kept worker's ``worker_resumed`` event (pause,
form time, bytes synced).

NCCL refuses two ranks on one GPU, so with fewer than two GPUs the NCCL scenarios cannot run:
they are reported as such, a one-agent NCCL job checks what one GPU can (the group's forming,
the steps, the losses), and the two scenarios run on gloo with the model on that GPU (every
agent shares it), which still takes the state's CUDA paths. ``--backend gloo`` (the default
without CUDA) runs them on the CPU. Needs only the repository, torch, etcdrun's runtime
dependencies and an etcd (``$ETCD_BIN`` or ``PATH``); bounded to about 5 minutes. Writes
``results.json`` and ``summary.md`` under ``--out`` (default ``$OUT``, else a temporary folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "in_place_nccl_worker.py"
CONF = "lease_ttl=2,last_call_timeout=1"  # bench/launchers.py's tuned etcdrun
STEP_S = 0.05  # the workers' sleep after each step
SETTLE = 3.0  # s of training in the full world before the event
AFTER = 3.0  # s of training after every rank resumed (the losses after the change)
FORM_TIMEOUT = 90.0  # agents' start, imports, CUDA's init, the first round
SOLO_STEPS = 40
POLL = 0.05
MIN_LEFT = 40.0  # s of --budget a scenario needs to be started


class Failed(Exception):
    pass


@dataclass
class Ctx:
    out: Path
    tag: str  # every process started carries it (bench/procs.py's sweep)
    pythonpath: str | None  # where etcdrun is importable from, when it is not installed
    timeout: float  # bound on one recovery, s
    end: float  # time.monotonic() by which every wait gives up (--budget)


@dataclass
class Plan:
    name: str  # kill | scale | solo
    label: str
    backend: str  # the workers' process group
    device: str  # cpu | cuda
    n0: int  # nodes at the start
    gpus: list[str] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES per node, in order
    miss: str = ""  # why it cannot run here (reported, not run)


# ---- what this machine has -----------------------------------------------------------------


def _etcdrun_path() -> str | None:
    """Make ``import etcdrun`` work from the bare repository (no ``pip install``): a folder of
    links laid out as pyproject.toml's package-dir maps it. None when etcdrun is installed.
    """
    if importlib.util.find_spec("etcdrun") is not None:
        return None
    pkg = Path(tempfile.mkdtemp(prefix="in_place_nccl-path-")) / "etcdrun"
    pkg.mkdir()
    links = {p.name: p for p in (ROOT / "agent" / "_root").iterdir()}
    links |= {sub: ROOT / sub for sub in ("agent", "rendezvous", "proto")}
    for name, target in links.items():
        if not (pkg / name).exists():
            (pkg / name).symlink_to(target)
    sys.path.insert(0, str(pkg.parent))
    importlib.invalidate_caches()
    return str(pkg.parent)


def _missing() -> str:
    """What etcdrun's agent needs and this machine lacks, in words; "" when nothing."""
    mods = [m for m in ("grpc", "google.protobuf", "tenacity") if not _has(m)]
    if mods:
        return f"Python packages {', '.join(mods)} (etcdrun's runtime dependencies)"
    from etcdrun.rendezvous.localetcd.member import find_etcd

    try:
        if find_etcd() is None:
            return "an etcd binary (set $ETCD_BIN or put etcd on PATH)"
    except RuntimeError as e:
        return str(e)
    return ""


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def plans(backend: str, gpus: int, nodes: int, fallback: bool) -> list[Plan]:
    """The scenarios to run. ``gpus``: GPUs to use with NCCL, one agent each; ``nodes``: the
    kill scenario's agents on gloo (the CPU, or with too few GPUs for NCCL, the one GPU).
    """
    if backend == "gloo":
        return [
            Plan("kill", "gloo, CPU: kill -9", "gloo", "cpu", nodes),
            Plan("scale", "gloo, CPU: newcomer", "gloo", "cpu", nodes - 1),
        ]
    n = gpus
    ids = [str(i) for i in range(n)]
    if n >= 2:
        return [
            Plan("kill", f"NCCL, {n} GPUs: kill -9", "nccl", "cuda", n, ids),
            Plan("scale", f"NCCL, {n} GPUs: newcomer", "nccl", "cuda", n - 1, ids),
        ]
    why = f"NCCL needs a GPU per rank (two ranks on one GPU are refused); {gpus} visible"
    out = [
        Plan("kill", "NCCL: kill -9", "nccl", "cuda", 2, miss=why),
        Plan("scale", "NCCL: newcomer", "nccl", "cuda", 1, miss=why),
        Plan("solo", "NCCL, 1 GPU: one node, no change", "nccl", "cuda", 1, ["0"]),
    ]
    if fallback:
        ids = ["0"] * nodes
        out += [
            Plan("kill", "gloo, CUDA tensors on 1 GPU: kill -9", "gloo", "cuda", nodes, ids),
            Plan("scale", "gloo, CUDA tensors on 1 GPU: newcomer", "gloo", "cuda", nodes - 1, ids),
        ]
    return out


# ---- one scenario ------------------------------------------------------------------------


class Scenario:
    """One plan's etcd, agents and clean-up; ``run()`` returns its figures."""

    def __init__(self, plan: Plan, ctx: Ctx):
        self.plan, self.ctx, self.tag, self.pythonpath = plan, ctx, ctx.tag, ctx.pythonpath
        self.dir = ctx.out / f"{plan.name}-{plan.backend}-{plan.device}"
        self.steps_dir = self.dir / "steps"
        self.run_id = f"nccl-bench-{uuid.uuid4().hex[:8]}"
        self.agents: list = []
        self.etcd = None

    def nnodes(self) -> str:
        n0 = self.plan.n0
        return {"kill": f"{max(1, n0 - 1)}:{n0}", "scale": f"{n0}:{n0 + 1}"}.get(
            self.plan.name, "1:1"
        )

    def start_agent(self) -> float:
        from bench.procs import TAG_VAR, Agent

        i = len(self.agents)
        name = f"node{i}"
        drop = ("PET_", "TORCHELASTIC_", "ETCDCTL_", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env |= {TAG_VAR: self.tag, "BENCH_NODE": name, "PYTHONUNBUFFERED": "1"}
        env["PET_LOG_DIR"] = str(self.dir / f"logs-{name}")  # its events.jsonl
        if self.plan.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.plan.gpus[i % len(self.plan.gpus)]
        if self.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [self.pythonpath, env.get("PYTHONPATH")])
            )
        steps = str(SOLO_STEPS) if self.plan.name == "solo" else "0"
        cmd = [sys.executable, "-m", "etcdrun", "--nnodes", self.nnodes(), "--nproc-per-node", "1"]
        cmd += ["--rdzv-backend", "etcd", "--rdzv-endpoint", self.etcd.endpoints]
        cmd += ["--rdzv-id", self.run_id, "--rdzv-conf", CONF, "--max-restarts", "0"]
        cmd += ["--monitor-interval", "0.1", "--prewarm", "none"]
        cmd += [
            str(WORKER),
            str(self.steps_dir),
            self.plan.device,
            self.plan.backend,
            str(STEP_S),
            steps,
        ]
        a = Agent(name, cmd, env, self.dir / f"{name}.log")
        self.agents.append(a)
        return a.start()

    def records(self) -> list[dict]:
        from bench.step_metrics import read_log

        return read_log(self.steps_dir)

    def wait(self, cond, timeout: float, what: str, watch: list) -> None:
        timeout = max(5.0, min(timeout, self.ctx.end - time.monotonic()))
        deadline = time.monotonic() + timeout
        while not cond():
            gone = [a for a in watch if not a.alive()]
            if gone:
                raise Failed(f"{gone[0].name} exited while waiting for {what}: {_why(gone[0])}")
            if time.monotonic() > deadline:
                raise Failed(f"no {what} within {timeout:.0f} s; {_why(watch[-1])}")
            time.sleep(POLL)

    def training(self, nodes: list, world: int, at_least: int) -> bool:
        from bench.step_metrics import steps

        recs = self.records()
        return all(
            len([r for r in steps(recs, a.name) if r["w"] == world]) >= at_least for a in nodes
        )

    def run(self) -> dict:
        from etcdrun.rendezvous.localetcd import LocalEtcd

        self.steps_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = LocalEtcd().start()
        try:
            for _ in range(self.plan.n0):
                self.start_agent()
            if self.plan.name == "solo":
                return self._solo()
            return self._change()
        finally:
            self.close()

    def _solo(self) -> dict:
        a = self.agents[0]
        self.wait(lambda: not a.alive(), FORM_TIMEOUT, "end of the one-node job", [])
        recs = self.records()
        done = [r for r in recs if r["k"] == "step"]
        if a.proc.returncode != 0 or len(done) < SOLO_STEPS:
            raise Failed(f"exit {a.proc.returncode} after {len(done)} steps: {_why(a)}")
        return {"steps": len(done), "exit": a.proc.returncode, "_recs": recs}

    def _change(self) -> dict:
        from bench.in_place_nccl_worker import figures
        from bench.step_metrics import last_ranks, resumed

        n0, kill = self.plan.n0, self.plan.name == "kill"
        self.wait(
            lambda: self.training(self.agents, n0, 3),
            FORM_TIMEOUT,
            f"{n0} nodes training",
            self.agents,
        )
        time.sleep(SETTLE)
        if kill:
            ranks = last_ranks(self.records())
            victim = max(
                (a for a in self.agents if ranks.get(a.name, 0) != 0), key=lambda a: ranks[a.name]
            )
            who = f"{victim.name} (rank {ranks[victim.name]})"
            t = victim.kill_node()
            survivors = [a for a in self.agents if a is not victim]
            world, joining = n0 - 1, []
        else:
            survivors = list(self.agents)
            t = self.start_agent()
            world, joining, who = n0 + 1, [self.agents[-1]], f"{self.agents[-1].name} (newcomer)"
        names = [a.name for a in survivors]
        self.wait(
            lambda: resumed(self.records(), [a.name for a in survivors + joining], t, world),
            self.ctx.timeout,
            f"a step with world {world} on every node",
            survivors + joining,
        )
        time.sleep(AFTER)
        recs = self.records()
        new = joining[0].name if joining else None
        out = {"event": who, **figures(recs, self.events(names), names, t, world, new)}
        out["_recs"] = recs
        return out

    def events(self, nodes: list[str]) -> list[dict]:
        out = []
        for name in nodes:
            path = self.dir / f"logs-{name}" / "events.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    try:
                        out.append({**json.loads(line), "_node": name})
                    except ValueError:
                        continue
        return out

    def close(self) -> None:
        from bench.procs import sweep

        try:
            for a in self.agents:
                a.stop()
            sweep(self.tag)
        finally:
            if self.etcd is not None:
                self.etcd.stop()


def _why(agent) -> str:
    """The agent's last lines that say what went wrong (etcdrun names the root cause)."""
    try:
        lines = agent.log.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    keys = ("Error", "error", "MISS", "failed", "Traceback", "exit")
    hits = [ln.strip() for ln in lines if any(k in ln for k in keys)]
    return " | ".join(ln[:300] for ln in (hits[-3:] or lines[-3:]))


# ---- figures (pure: from the step log and the events) --------------------------------------


def run_plan(plan: Plan, ctx: Ctx) -> dict:
    from bench.in_place_nccl_worker import loss_check, reference, verdict
    from bench.procs import sweep

    head = {
        "scenario": plan.name,
        "label": plan.label,
        "backend": plan.backend,
        "device": plan.device,
    }
    head |= {"nodes_at_start": plan.n0, "gpus": plan.gpus}
    if plan.miss:
        return {**head, "outcome": "miss", "note": plan.miss, "pass": False}
    t0 = time.monotonic()
    try:
        res = {"outcome": "ok", **Scenario(plan, ctx).run()}
    except Failed as f:
        res = {"outcome": "failed", "note": str(f)}
    except Exception as exc:  # one harness error must not lose the other scenarios
        res = {"outcome": "error", "note": f"{type(exc).__name__}: {exc}"}
        sweep(ctx.tag)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    recs = res.pop("_recs", None)
    if recs:
        top = max((r["s"] for r in recs if r["k"] == "step"), default=0)
        res |= loss_check(recs, reference(top, "cuda:0" if plan.device == "cuda" else "cpu"))
    ok, why = verdict(plan.name, res)
    return {**head, **res, "pass": ok, "why": why}


# ---- the report ----------------------------------------------------------------------------


def machine() -> dict:
    import torch

    info = {"cpus": os.cpu_count(), "torch": torch.__version__, "gpus": 0}
    info["machine"] = f"no GPU, {info['cpus']} CPUs"
    if torch.cuda.is_available():
        n, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        info |= {"gpus": n, "gpu_name": name, "nccl": nccl}
        info["machine"] = f"{n} x {name} (NCCL {nccl}), {info['cpus']} CPUs"
    return info


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo"
    )
    ap.add_argument(
        "--gpus", type=int, help="GPUs to use, one agent each (default: all, at most 3)"
    )
    ap.add_argument("--nodes", type=int, default=3, help="agents of the kill scenario without NCCL")
    ap.add_argument("--no-fallback", action="store_true", help="on one GPU: skip gloo on CUDA")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound on one recovery, s")
    ap.add_argument("--budget", type=float, default=240.0, help="every wait ends by then, s")
    ap.add_argument("--only", default="", help="scenarios to run: kill,scale,solo")
    ap.add_argument("--out", help="results folder (default: $OUT, else a temporary folder)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    cuda = torch.cuda.is_available()
    backend = args.backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not (cuda and torch.distributed.is_nccl_available()):
        print("in_place_nccl: --backend nccl needs a CUDA GPU and NCCL; this machine has none")
        return 2
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="in_place_nccl-"))
    out.mkdir(parents=True, exist_ok=True)
    pythonpath = _etcdrun_path()
    missing = _missing()
    if missing:
        print(f"in_place_nccl: this machine lacks {missing}")
        return 2
    from bench.procs import become_subreaper

    become_subreaper()
    meta = machine() | {"backend": backend, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    n_gpus = min(args.gpus or 3, meta["gpus"]) if backend == "nccl" else 0  # gloo: the CPU
    todo = plans(backend, n_gpus, args.nodes, not args.no_fallback)
    if args.only:
        todo = [p for p in todo if p.name in args.only.split(",")]
    t0 = time.monotonic()
    ctx = Ctx(out, uuid.uuid4().hex, pythonpath, args.timeout, t0 + args.budget)
    print(f"in_place_nccl: {meta['machine']}; out: {out}", flush=True)
    done = []
    for plan in todo:
        if ctx.end - time.monotonic() < MIN_LEFT and not plan.miss:
            head = {"scenario": plan.name, "label": plan.label, "outcome": "skipped"}
            done.append({**head, "note": "no time left (--budget)", "pass": False})
            continue
        r = run_plan(plan, ctx)
        done.append(r)
        keys = ("outcome", "pass", "why", "note", "work_lost", "pause_s", "loss_max_err")
        print(f"  [{plan.label}] {json.dumps({k: r.get(k) for k in keys})}", flush=True)
    meta["duration_s"] = round(time.monotonic() - t0)
    res = {"meta": meta, "scenarios": done}
    (out / "results.json").write_text(json.dumps(res, indent=1))
    from bench.in_place_nccl_worker import markdown

    text = markdown(res)
    (out / "summary.md").write_text(text)
    print(text)
    ran = [s for s in done if s["outcome"] != "miss"]
    return 0 if ran and all(s["pass"] for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
