"""bench/rendezvous_scale.py's measurements: etcd's metrics, CPU from /proc, and event times.

Why apart: these are the figures' definitions (what a "write" or a round's "time" is, read from
etcd's /metrics and the rendezvous' events); rendezvous_scale.py runs the rounds and reports.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter

METRICS = {
    "writes": "etcd_server_proposals_applied_total",
    "revisions": "etcd_debugging_mvcc_current_revision",
    "puts": "etcd_mvcc_put_total",
    "deletes": "etcd_mvcc_delete_total",
    "ranges": "etcd_mvcc_range_total",
    "watch_events": "etcd_debugging_mvcc_events_total",
    "watch_msgs": 'grpc_server_msg_sent_total{grpc_method="Watch",'
    'grpc_service="etcdserverpb.Watch",grpc_type="bidi_stream"}',
    "sent_bytes": "etcd_network_client_grpc_sent_bytes_total",
    # the trouble signs of a round etcd cannot keep up with: applies over 100 ms, and leases
    # that expired on the server (each takes its agent key and join record with it)
    "slow_applies": "etcd_server_slow_apply_total",
    "leases_expired": "etcd_debugging_server_lease_expired_total",
    # keep-alives etcd renewed (the leader's count): beside what the keepers sent and got answered
    "renewals": "etcd_debugging_lease_renewed_total",
}


def cpu_seconds(pids: list[int], path: str = "/proc/{}/stat") -> float:
    """User + system CPU of these processes (all their threads) so far, from /proc."""
    total = 0
    for pid in pids:
        try:
            with open(path.format(pid)) as f:
                fields = f.read().rpartition(")")[2].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            return float("nan")
    return total / os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's rendezvous driver threads (``rdzv-<node id>``) and
    its client's threads (``etcd-*``), by thread name, from /proc/self/task/<tid>/stat: to tell
    the leader's own work apart from the other handlers sharing its process. Threads of the same
    name (several clients' ``etcd-watch``, with ``--per-client``) are summed.
    """
    out: dict[str, float] = {}
    for th in threading.enumerate():
        if th.native_id is not None and th.name.startswith(("rdzv-", "etcd-")):
            got = cpu_seconds([th.native_id], f"/proc/self/task/{th.native_id}/stat")
            if got == got:  # not NaN: the thread was still there
                out[th.name] = out.get(th.name, 0.0) + got
    return out


def leader_cpu(
    evs: list[dict],
    rnd: int,
    before: dict[int, dict],
    after: dict[int, dict],
    proc_delta: list[float],
    counts: list[int],
) -> dict:
    """The CPU of the node that froze round ``rnd`` (the leader) during the round: its driver
    thread, its process's watch thread (which runs the leader's watch callbacks, and every other
    handler's there) and its whole process, beside the other worker processes' mean.
    """
    node = next(
        (e["node"] for e in evs if e["event"] == "round_frozen" and e.get("round") == rnd), None
    )
    w = next((e["worker"] for e in evs if node is not None and e.get("node") == node), None)
    if w is None:
        return {}

    def spent(name: str) -> float | None:
        if name not in after.get(w, {}):
            return None
        return round(after[w][name] - before.get(w, {}).get(name, 0.0), 2)

    others = [c for i, c in enumerate(proc_delta) if i != w]
    return {
        "node": node,
        "worker": w,
        "handlers": counts[w],
        "thread_cpu": spent(f"rdzv-{node}"),
        "watch_thread_cpu": spent("etcd-watch"),
        "process_cpu": proc_delta[w] if w < len(proc_delta) else None,
        "others_mean_cpu": round(sum(others) / len(others), 2) if others else None,
    }


def machine_cpu() -> float:
    """Busy CPU seconds of the whole machine so far (to see load from other programs)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError, IndexError):
        return float("nan")


QUIET_BUSY = 0.25  # CPUs: the machine counts as quiet below this (our idle pool and etcd included)


def wait_quiet_machine(max_wait: float, window: float = 2.0) -> tuple[float, float]:
    """Wait (bounded) until the whole machine is under ``QUIET_BUSY`` CPUs busy over ``window``;
    (seconds waited, CPUs busy in the last window). Why: with two CPUs taken by other programs (two
    busy loops) N=1000 all at once never formed its round — most sessions lost ("no keep-alive
    acknowledged") while etcd itself was lightly loaded: the simulation's own processes starved,
    which a real job, one agent per machine, is not (bench/results/rendezvous_scale.md, 'N=1000 on a
    busy machine').
    """
    t0 = time.monotonic()
    while True:
        a = machine_cpu()
        time.sleep(window)
        busy = (machine_cpu() - a) / window
        if busy < QUIET_BUSY or time.monotonic() - t0 >= max_wait:
            return round(time.monotonic() - t0, 1), round(busy, 2)


# Served by each member on its own (sum over members); the rest every member applies (max).
SUMMED = ("ranges", "watch_events", "watch_msgs", "sent_bytes", "slow_applies")


def snapshot(
    urls: list[str],
    etcd_pids: list[int],
    worker_pids: list[int],
    relay_pids: list[int] = (),  # type: ignore[assignment]
    proxy=None,  # scale_proxy.GrpcProxy, when the clients talk to etcd through one
) -> dict:
    """Every figure a round's delta is taken of: etcd's metrics over its members, CPU of etcd
    (summed and per member), of each worker process, of the keep-alive relays and the gRPC
    proxy, of the whole machine; the proxy's bytes sent to the clients.
    """
    per = [scrape(u) for u in urls]
    return {
        "relay_cpu": cpu_seconds(list(relay_pids)),
        "proxy_cpu": cpu_seconds([proxy.pid]) if proxy is not None else 0.0,
        "proxy_coalesced": proxy.coalesced() if proxy is not None else 0,
        **{k: (sum if k in SUMMED else max)(p[k] for p in per) for k in METRICS},
        "watch_events_by_member": [p["watch_events"] for p in per],
        "etcd_cpu": cpu_seconds(etcd_pids),
        "etcd_cpu_by_member": [cpu_seconds([p]) for p in etcd_pids],
        "workers_cpu": cpu_seconds(worker_pids),
        "proc_cpu": [cpu_seconds([p]) for p in worker_pids],
        "machine_cpu": machine_cpu(),
        "t": time.monotonic(),
    }


def scrape(url: str) -> dict[str, float]:
    out = {}
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, _, val = line.rpartition(" ")
                out[name] = float(val)
    return {k: out.get(m, float("nan")) for k, m in METRICS.items()}


def _diff(k: str, a: object, b: object) -> object:
    if isinstance(a, list):
        return [_diff(k, x, y) for x, y in zip(a, b, strict=True)]
    return round(b - a, 2) if k.endswith("_cpu") or k == "t" else int(b - a)


def delta(a: dict, b: dict) -> dict:
    d = {k: _diff(k.replace("_by_member", ""), a[k], b[k]) for k in a}
    ours = d["etcd_cpu"] + d["workers_cpu"] + d["relay_cpu"] + d["proxy_cpu"]
    d["other_cpu"] = round(d.pop("machine_cpu") - ours, 2)
    return d


def last(evs: list[dict], kind: str, rnd: int | None = None) -> float | None:
    ts = [e["time"] for e in evs if e["event"] == kind and (rnd is None or e.get("round") == rnd)]
    return max(ts) if ts else None


def gc_pauses(done: dict[int, tuple]) -> dict:
    """Longest per-process total of garbage-collector pauses in the round, and gen-2 runs."""
    return {
        "gc_s": round(max((d[2] for d in done.values()), default=0.0), 3),
        "gc2": sum(d[3] for d in done.values()),
    }


def sessions(evs: list[dict], since_t: float) -> dict:
    """Sessions opened and lost since ``since_t``: more than N opened means re-registrations.
    ``lost_why``: the losses by reason, numbers blanked ("no keep-alive acknowledged for #s"),
    so a spiral shows whether etcd stopped answering or the process stopped asking.
    """
    lost = [
        e.get("reason", "")
        for e in evs
        if e["event"] == "session_lost" and e["time"] >= since_t and e.get("reason") != "revoked"
    ]  # a revoke is a leave, not a loss
    return {
        "opened": sum(1 for e in evs if e["event"] == "session_opened" and e["time"] >= since_t),
        "lost": len(lost),
        "lost_why": dict(Counter(re.sub(r"\d+(\.\d+)?", "#", r) for r in lost).most_common(4)),
    }


def fanout(evs: list[dict], rnd: int) -> list[float]:
    """Per worker process: frozen -> its last participant accepted. Equal values across
    processes mean the cost is CPU shared by all, not one slow process.
    """
    frozen = last(evs, "round_frozen", rnd)
    if frozen is None:
        return []
    ws = sorted({e["worker"] for e in evs})
    return [
        round(t - frozen, 3)
        for w in ws
        if (t := last([e for e in evs if e["worker"] == w], "round_accepted", rnd))
    ]


def check_infos(results: list, n_expected: int, rnd: int) -> list[str]:
    """Everyone got the same round, node count and master; ranks are 0..k-1."""
    bad = [r for r in results if not isinstance(r, tuple)]
    if bad:
        return [f"{len(bad)} participant(s) failed, first: {bad[0]}"]
    problems = []
    if {r[1] for r in results} != {rnd}:
        problems.append(f"rounds {sorted({r[1] for r in results})}, expected {rnd}")
    if sorted(r[2] for r in results) != list(range(n_expected)):
        problems.append("node ranks are not 0..k-1")
    if {r[3] for r in results} != {n_expected} or len({(r[4], r[5]) for r in results}) != 1:
        problems.append("node count or master differ between participants")
    return problems


def py_spy(pids: list[int], out_dir: str | None, seconds: float) -> list[subprocess.Popen]:
    """Sample every worker during both rounds (raw collapsed stacks, one file per worker)."""
    if not out_dir:
        return []
    exe = shutil.which("py-spy")
    if exe is None:
        print("py-spy not found (pip install py-spy); no profile", file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    return [
        subprocess.Popen(
            [
                exe,
                "record",
                "--pid",
                str(pid),
                "--duration",
                str(int(seconds)),
                "--rate",
                "50",
                "--gil",
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                os.path.join(out_dir, f"worker-{pid}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in pids
    ]


def since(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a
