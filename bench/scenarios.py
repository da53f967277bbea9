"""The issue's scenarios, one trial at a time, for any launcher in bench/launchers.py.

Every wait has a bound; a launcher that never gets there is a result ("never (timeout X s)"),
and one whose agents all exit is another ("job died"). Every trial runs in a ``Job``: a fresh
etcd when the launcher needs one (``--enable-v2`` for torchrun's etcd-v2), a fresh run id, and
on exit every agent and every tagged process killed and checked gone.

Times are worker-measured end points minus the harness's action (last agent's start, the kill,
the newcomer's start). ``spawn`` ("workers running", what the targets are about) is the newest,
over the nodes, of the ``BENCH_START`` line (the worker's first line, before ``import torch``) of
the worker that went on to print ``BENCH_READY`` with the expected WORLD_SIZE: the launcher has
started every worker with the new world's environment (torchrun's ``WorkerState.RUNNING``).
``value`` ("workers ready") is the newest such ``BENCH_READY``: ``init_process_group("gloo")``
returned everywhere. Between the two lie the workers' own Python start, ``import torch`` and the
gloo init, which no launcher controls.

A kill or a newcomer comes once the job is in its steady state (``steady``: the collectives
have run ``SETTLE`` s and the whole group, workers and anything the launcher keeps beside them,
is CPU-quiet), as a node fails or arrives while a job trains, not while it is still starting:
on these 2 CPUs a disturbance 1 s after the first round landed while etcdrun's standbys for the
next round were still importing torch, and each trial measured a different share of that.
"""

from __future__ import annotations

import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from bench.launchers import ETCDRUN, Launcher
from bench.procs import Agent, listener_pid
from bench.trial import (
    FORM_TIMEOUT,
    SETTLE,
    Ctx,
    Fail,
    Job,
    Trial,
    _trial,
    wait_quiet,
    wait_world,
)

__all__ = [
    "Ctx",
    "Trial",
    "agent_rss",
    "first_round",
    "help_times",
    "idle_requests",
    "kill_node",
    "scale_up",
]


@_trial
def first_round(
    ctx: Ctx, launcher: Launcher, n: int, max_nodes: int, name: str, stagger: bool = False
) -> Trial:
    """Scenarios 1 and 2: ``n`` agents, ``--nnodes`` min..max_nodes.

    ``stagger``: start ``n - 1`` agents, wait until they sit waiting in the rendezvous, then
    start the last one (as on a real cluster, where one node boots last). Without it all ``n``
    start together, and on this 2-CPU machine the figure is mostly ``n`` agents' start-up CPU.
    ``extra["agent_cpu_s"]``: the median agent's own CPU seconds when every worker was ready.
    """
    nnodes = f"{n}:{max_nodes}" if max_nodes == n else f"2:{max_nodes}"
    with Job(ctx, launcher, nnodes, "allreduce", name) as job:
        extra = {}
        if stagger:
            job.start(n - 1)
            extra["settle_s"] = round(wait_quiet(job.agents), 2)
        t0 = job.start(n - len(job.agents))
        ready, spawn = wait_world(
            job.agents,
            job.agents[0].t_start,
            n,
            FORM_TIMEOUT + launcher.last_call,
            "the last start",
        )
        extra["agent_cpu_s"] = round(statistics.median(a.cpu_s() for a in job.agents), 3)
        return Trial(ready - t0, spawn=None if spawn is None else spawn - t0, extra=extra)


def _victim(job: Job, which: str) -> tuple[Agent, str]:
    ranks = {a.name: a.group_rank() for a in job.agents}
    if which == "rank0":
        if job.launcher.backend == "c10d":
            host = listener_pid(job.port, [a.pid for a in job.agents])
            a = next((a for a in job.agents if a.pid == host), None)
            if a is None:
                raise Fail("error", "could not tell which agent hosts the c10d store")
            return a, f"store host (node rank {ranks[a.name]})"
        a = next(a for a in job.agents if ranks[a.name] == 0)
        return a, "node rank 0"
    host = (
        listener_pid(job.port, [a.pid for a in job.agents])
        if job.launcher.backend == "c10d"
        else None
    )
    cands = [a for a in job.agents if ranks[a.name] not in (None, 0) and a.pid != host]
    a = max(cands, key=lambda a: ranks[a.name])
    return a, f"node rank {ranks[a.name]}"


def steady(agents: list[Agent]) -> float | None:
    """``SETTLE`` s of collectives, then until the group is CPU-quiet (bounded: a launcher
    that never goes quiet is disturbed all the same); seconds waited after ``SETTLE``, None
    when it never went quiet.
    """
    time.sleep(SETTLE)
    try:
        return round(wait_quiet(agents, timeout=30.0), 2)
    except Fail as f:
        if f.outcome == "died":
            raise
        return None


@_trial
def kill_node(ctx: Ctx, launcher: Launcher, n: int, which: str, mode: str, name: str) -> Trial:
    """Scenarios 3 (``member``) and 4 (``rank0``): kill -9 one node of ``n`` (min 2)."""
    with Job(ctx, launcher, f"2:{n}", mode, name) as job:
        job.start(n)
        wait_world(job.agents, job.agents[0].t_start, n, FORM_TIMEOUT, "the start")
        settled = steady(job.agents)
        victim, who = _victim(job, which)
        t_kill = victim.kill_node()
        survivors = [a for a in job.agents if a is not victim]
        try:
            ready, spawn = wait_world(survivors, t_kill, n - 1, ctx.recover_timeout, "the kill")
        except Fail as f:
            raise Fail(f.outcome, f"killed {who}: {f.note}", f.after) from None
        return Trial(
            ready - t_kill,
            spawn=None if spawn is None else spawn - t_kill,
            note=f"killed {who}",
            extra={"t_kill": t_kill, "settle_s": settled},
        )


@_trial
def scale_up(ctx: Ctx, launcher: Launcher, n: int, name: str) -> Trial:
    """Scenario 5: n-1 agents running (``--nnodes 2:n``), then a newcomer."""
    with Job(ctx, launcher, f"2:{n}", "allreduce", name) as job:
        job.start(n - 1)
        wait_world(
            job.agents, job.agents[0].t_start, n - 1, FORM_TIMEOUT + launcher.last_call, "the start"
        )
        settled = steady(job.agents)
        t_new = job.start(1)
        ready, spawn = wait_world(job.agents, t_new, n, ctx.recover_timeout, "the newcomer's start")
        spawn = None if spawn is None else spawn - t_new
        return Trial(ready - t_new, spawn=spawn, extra={"settle_s": settled})


@_trial
def agent_rss(ctx: Ctx, launcher: Launcher, n: int, name: str) -> Trial:
    """Scenario 6b: peak RSS (VmHWM) of each agent after a few seconds of a running job."""
    with Job(ctx, launcher, f"{n}:{n}", "allreduce", name) as job:
        job.start(n)
        wait_world(job.agents, job.agents[0].t_start, n, FORM_TIMEOUT, "the start")
        time.sleep(3.0)
        rss = [r for r in (a.rss_mb() for a in job.agents) if r is not None]
        if len(rss) != n:
            raise Fail("died", "an agent exited before its RSS was read")
        return Trial(statistics.median(rss), extra={"per_agent_mb": rss})


def help_times(bindir: Path, kinds: list[str], reps: int) -> dict[str, list[float]]:
    """Scenario 6a: ``<launcher> --help`` wall times, interleaved so load hits both alike."""
    out: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(reps):
        for k in kinds:
            t = time.perf_counter()
            subprocess.run(
                [str(bindir / k), "--help"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=True,
                timeout=60,
            )
            out[k].append(time.perf_counter() - t)
    return out


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("grpc_server_msg_received_total", "etcd_http_received_total")):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out


def _method(key: str) -> str:
    for label in ('grpc_method="', 'method="'):
        if label in key:
            return key.split(label, 1)[1].split('"', 1)[0]
    return key


@_trial
def idle_requests(ctx: Ctx, launcher: Launcher, n: int, name: str) -> Trial:
    """Scenario 8: etcd requests per second per agent while the job runs unchanged.

    gRPC: ``grpc_server_msg_received_total`` (a unary call is one message; a keep-alive on the
    lease stream is one message). etcd v2 (torchrun's etcd-v2): ``etcd_http_received_total``.
    """
    if not launcher.needs_etcd:
        raise Fail("error", "does not use etcd")
    with Job(ctx, launcher, f"{n}:{n}", "idle", name) as job:
        job.start(n)
        wait_world(job.agents, job.agents[0].t_start, n, FORM_TIMEOUT, "the start")
        time.sleep(2.0)
        url = job.metrics_url()
        before, t1 = _scrape(url), time.monotonic()
        time.sleep(ctx.idle_window)
        after, t2 = _scrape(url), time.monotonic()
        if not all(a.alive() for a in job.agents):
            raise Fail("died", "an agent exited during the idle window")
        per = {}
        for key, val in after.items():
            d = val - before.get(key, 0.0)
            if d > 0:
                m = _method(key)
                per[m] = per.get(m, 0.0) + d
        secs = t2 - t1
        total = sum(per.values()) / secs / n
        ours = launcher.kind == ETCDRUN or launcher.backend == "etcd-v3"  # our client's leases
        keep = per.get("LeaseKeepAlive", 0.0) / secs / n if ours else 0.0
        return Trial(
            total,
            extra={
                "keepalive_per_s": keep,
                "other_per_s": total - keep,
                "window_s": secs,
                "by_method": {k: int(v) for k, v in sorted(per.items())},
            },
        )
