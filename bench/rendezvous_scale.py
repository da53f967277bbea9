#!/usr/bin/env python3
"""Rendezvous at scale: N real participants in P processes, on 1 or 3 etcd members, two rounds.

Why: design.md L5 promises O(N) etcd writes and watch events per round; issue 14 asks for N up to
4096 on one member and on a 3-member cluster (where every write goes through raft). This runs the
real EtcdRendezvousHandler code (no fakes): N handlers spread over P worker processes, each
process sharing one EtcdClient among its handlers (one gRPC channel, one watch stream, one
keep-alive thread per process), a caller thread per handler as an agent would have. The
keep-alives of a process's leases go, a batch per stream, through a relay process of its own
(scale_keepalive.py: in-process, the handler threads starve them of the GIL), and each round's
row counts only when the simulation kept up: no lease over 1.5 keep-alive intervals without an
answer, none given up (the keep-alive rate achieved against the rate due is printed beside it).

Per (cluster size, N), on a fresh etcd (LocalEtcd, fast raft timings, random ports):
- round 1: every handler registers and joins at once (min = N-1, max = N, so the freeze comes
  at max, never from the last-call timer). Timed from the last ``node_joined`` event to the last
  ``round_accepted`` event (every participant has read the frozen round naming it).
- round 2: one participant (not the leader, unless --leave leader) leaves with ``shutdown()``;
  timed from just before that call to the last survivor's ``round_accepted`` of the next round.
Times are ``time.time()`` stamps of events taken in different processes of this one machine, so
they share one clock. Writes are raft proposals applied (every Put/Txn/DeleteRange/LeaseGrant/
LeaseRevoke, failed-compare Txns included; keep-alives are not proposals in etcd 3.4), read from
etcd's /metrics before and after the round (the most any member applied); watch events are
``etcd_debugging_mvcc_events_total`` (events delivered to watchers, one per watcher per event),
summed over members and shown per member; bytes are ``etcd_network_client_grpc_sent_bytes_total``
(what the members sent their clients), beside the last round key's size (N watchers get it).
Writes of round 1 include registration (lease grant + agent key per participant). CPU: etcd's
from /proc (utime+stime, summed over members); the leader's (the node that froze the round) as
its driver thread's and its whole process's.
Figures and the commands that produced them: bench/results/rendezvous_scale.md.

Usage: ``python -m bench.rendezvous_scale [--n 10,100,1000] [--members 1,3] [--procs 4]
[--per-client K] [--keepalive relay|in-process] [--grpc-proxy] [--leave member]
[--lease-ttl 5] [--timeout 120] [--quiet-wait 120]
[--json out.json] [--svg plot.svg] [--py-spy DIR] [--etcd-log DIR] [--etcd-pprof]
[--etcd-cpus LIST] [--worker-cpus LIST]``. Exits 1 on a miss with ``--check``. The invariant
checker (rendezvous/tools/checker.py) vets each run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from bench.scale_args import parse
from bench.scale_keepalive import combine, keep_up
from bench.scale_metrics import (
    check_infos,
    delta,
    fanout,
    gc_pauses,
    last,
    leader_cpu,
    py_spy,
    sessions,
    since,
    snapshot,
    wait_quiet_machine,
)
from bench.scale_plot import fit_lines, write_svg
from bench.scale_pool import Pool
from bench.scale_proxy import GrpcProxy
from bench.scale_report import busy_notes, details, table, target_lines


# ---- main process -------------------------------------------------------------------------------
def run_one(n: int, members: int, procs: int, args: argparse.Namespace) -> dict:
    from etcdrun.rendezvous.localetcd import LocalEtcd

    p = max(1, min(procs, n))
    counts = [n // p + (i < n % p) for i in range(p)]
    run_id = "bench-" + uuid.uuid4().hex[:8]
    conf = {"last_call_timeout": 600, "join_timeout": args.timeout, "lease_ttl": args.lease_ttl}
    if args.shard_at is not None:  # 0: never sharded, whatever N
        conf["shard_at"] = args.shard_at
    res: dict = {"n": n, "members": members, "procs": p, "counts": counts, "problems": []}
    res["arrive_over"], res["per_client"] = args.arrive_over, args.per_client
    res["keepalive"] = args.keepalive
    res["shard_at"] = conf.get("shard_at")
    pprof = ["--enable-pprof"] if args.etcd_pprof else []
    with contextlib.ExitStack() as stack:
        etcd = stack.enter_context(LocalEtcd(members, log_to=args.etcd_log, extra_args=pprof))
        proxy = stack.enter_context(GrpcProxy(etcd.endpoint_list)) if args.grpc_proxy else None
        res["grpc_proxy"] = proxy is not None
        urls = [f"http://{ep}/metrics" for ep in etcd.endpoint_list]
        if members > 1:  # every client prefers the first endpoint: is that the raft leader?
            res["preferred"] = 0
            res["etcd_leader"] = etcd.members.index(etcd.wait_leader())
        cfg = {
            "endpoints": proxy.endpoint if proxy else etcd.endpoints,
            "relay_endpoints": etcd.endpoints,  # scale_proxy.py: keep-alives pass the proxy by
            "run_id": run_id,
            "min_nodes": max(1, n - 1),
            "max_nodes": n,
            "conf": conf,
            "arrive_over": args.arrive_over,
            "per_client": args.per_client,
            "worker_cpus": args.worker_cpus,
            "keepalive": args.keepalive,
        }
        res["etcd_cpus"], res["worker_cpus"] = args.etcd_cpus, args.worker_cpus
        if args.etcd_cpus:
            pin(etcd.pids, args.etcd_cpus)
        pool = Pool(counts, cfg)
        snap = functools.partial(snapshot, urls, etcd.pids, pool.pids, pool.relay_pids, proxy)
        spies: list[subprocess.Popen] = []
        try:
            pool.expect("ready", list(range(p)), 120)
            res["quiet_wait_s"], res["busy_before"] = wait_quiet_machine(args.quiet_wait)
            spies = py_spy(pool.pids, args.py_spy, 2 * args.timeout)
            time.sleep(1.0 if spies else 0)  # let py-spy attach
            r1, evs = join_round(pool, res, n, args, snap)
            if n >= 2 and not res["problems"]:
                res["round2"] = leave_round(pool, evs, r1, n, args, snap)
            check_run(pool, cfg["endpoints"], cfg, res)
        except (TimeoutError, RuntimeError) as e:
            res["problems"].append(str(e))
        finally:
            for s in spies:  # SIGINT: py-spy writes its file and exits
                s.send_signal(signal.SIGINT)
                s.wait(timeout=30)
            res["leftover_threads"] = pool.stop(60)
    return res


def pin(pids: list[int], cpus: list[int]) -> None:
    """Every thread of these processes onto ``cpus`` (threads started later inherit it): etcd
    on a core of its own, as it would have on its own machine, so that what fails is not etcd
    losing the CPU to 4096 simulated agents.
    """
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:
                pass  # a thread that ended meanwhile


def join_round(
    pool: Pool, res: dict, n: int, args: argparse.Namespace, snap: Callable[[], dict]
) -> tuple[dict[int, list], list[dict]]:
    """Round 1: everyone registers and joins at once. Fills ``res``; returns each process's
    participants' infos and the events seen so far.
    """
    every = list(range(res["procs"]))
    ka0 = ka_reading(pool, every)
    m0 = snap()
    t_go = time.time()
    for i in every:
        pool.send(i, "round1")
    pool.expect("armed", every, 60)
    done = pool.expect("done", every, args.arrive_over + args.timeout + 30, partial=True)
    m1 = snap()
    r1 = {i: done[i][1] for i in done}
    res["problems"] += [
        f"round 1: {s}" for s in check_infos([x for i in done for x in r1[i]], n, 1)
    ]
    if len(done) < len(every):
        res["problems"].append(
            f"round 1: {len(every) - len(done)} process(es) not done after {args.timeout + 30:g}s"
        )
    evs, res["warnings"] = collect(pool, every)
    d = delta(m0, m1)
    ka = ka_since(pool, every, ka0, args.lease_ttl)
    res["round1"] = {
        "go_to_registered": since(t_go, last(evs, "session_opened")),
        "go_to_last_join": since(t_go, last(evs, "node_joined", 1)),
        "join_to_frozen": since(last(evs, "node_joined", 1), last(evs, "round_frozen", 1)),
        "time": since(last(evs, "node_joined", 1), last(evs, "round_accepted", 1)),
        "go_to_all": since(t_go, last(evs, "round_accepted", 1)),
        "fanout": fanout(evs, 1),
        **sessions(evs, t_go),
        **gc_pauses(done),
        **d,
        "leader": leader_cpu(evs, 1, {}, threads(pool, every), d["proc_cpu"], res["counts"]),
        "keepalive": ka,
    }
    return r1, evs


def ka_reading(pool: Pool, which: list[int]) -> dict:
    """The workers' keep-alive counters now, combined (scale_keepalive.py)."""
    for i in which:
        pool.send(i, "keepalive")
    return combine([got[0] for got in pool.expect("keepalive", which, 60).values()])


def ka_since(pool: Pool, which: list[int], before: dict, ttl: int) -> dict:
    """Whether the simulation kept up since ``before``: read again once at least two keep-alive
    intervals have passed (a round can be shorter than one, and a rate over it is noise).
    """
    from etcdrun.rendezvous.client import RetryPolicy

    interval = RetryPolicy().keepalive_interval(ttl)
    time.sleep(max(0.0, before["t"] + 2 * interval - time.monotonic()))
    return keep_up(before, ka_reading(pool, which), interval)


def threads(pool: Pool, which: list[int]) -> dict[int, dict]:
    """Each worker's driver and client threads' CPU so far, by thread name."""
    for i in which:
        pool.send(i, "threads")
    return {i: got[0] for i, got in pool.expect("threads", which, 60).items()}


def check_run(pool: Pool, endpoints: str, cfg: dict, res: dict) -> None:
    """The invariant checker over what etcd holds and every accepted round; then close."""
    from etcdrun.rendezvous.client import EtcdClient
    from etcdrun.rendezvous.etcd.core.keys import RunKeys
    from etcdrun.rendezvous.tools import checker

    every = list(range(res["procs"]))
    with EtcdClient(endpoints) as c:
        evs, res["warnings"] = collect(pool, every)
        accepted = [e for e in evs if e["event"] == "round_accepted"]
        keys = RunKeys("/etcdrun", cfg["run_id"])
        res["problems"] += checker.check_run(c, keys, cfg["min_nodes"], res["n"], accepted)
        kv = c.get(keys.round)  # the last frozen round: what each of its N watchers received
        res["round_bytes"] = len(kv.value) if kv is not None else None
        res["shards"], res["shard_bytes"] = shard_sizes(c, keys, kv)
    pool.send(0, "close")
    pool.expect("closed", [0], 30)


def shard_sizes(c, keys, kv) -> tuple[int, float | None]:
    """A sharded round's shard count and the mean size of a shard, which each node gets by the
    watch of its shard key beside the header it watches (0 and None for a round that lists its
    participants itself).
    """
    from etcdrun.proto import etcdrun_state_pb2 as st

    if kv is None:
        return 0, None
    msg = st.RoundState.FromString(kv.value)
    if not msg.shards:
        return 0, None
    got = c.get_prefix(keys.shards).kvs
    return msg.shards, sum(len(s.value) for s in got) / max(1, len(got))


def collect(pool: Pool, which: list[int]) -> tuple[list[dict], dict]:
    """Every event the workers saw so far, and their logged warnings."""
    for i in which:
        pool.send(i, "events")
    evs: list[dict] = []
    warnings = {}
    for i, (e, count, first) in pool.expect("events", which, 60).items():
        evs += [{**x, "worker": i} for x in e]
        if count:
            warnings[f"worker {i}"] = {"count": count, "first": first}
    return evs, warnings


def leave_round(
    pool: Pool,
    evs: list[dict],
    r1: dict[int, list],
    n: int,
    args: argparse.Namespace,
    snap: Callable[[], dict],
) -> dict:
    """One participant leaves; time until every survivor accepted the next round."""
    leader = next(e["node"] for e in evs if e["event"] == "round_frozen" and e["round"] == 1)
    by_rank = sorted((x for xs in r1.values() for x in xs), key=lambda r: r[2])
    leaving = (
        leader
        if args.leave == "leader"
        else next(r[0] for r in by_rank[n // 2 :] + by_rank if r[0] != leader)
    )
    owner = next(i for i, xs in r1.items() if any(x[0] == leaving for x in xs))
    every = list(range(len(pool.conns)))
    for i in every:
        pool.send(i, "arm", leaving)
    pool.expect("armed", every, 60)
    th2 = threads(pool, every)
    ka2 = ka_reading(pool, every)
    m2 = snap()
    pool.send(owner, "leave", leaving)
    t_leave, t_left, ok = pool.expect("left", [owner], 30)[owner]
    done = pool.expect("done", every, args.timeout + 30, partial=True)
    m3 = snap()
    r2 = [x for i in done for x in done[i][1]]
    evs, _ = collect(pool, every)
    d = delta(m2, m3)
    ka = ka_since(pool, every, ka2, args.lease_ttl)
    counts = [len(xs) for _, xs in sorted(r1.items())]
    out = {
        "left": "leader" if leaving == leader else "member",
        "shutdown_s": t_left - t_leave,
        "revoked": ok,
        "time": since(t_leave, last(evs, "round_accepted", 2)),
        "leave_to_started": since(t_leave, last(evs, "round_started", 2)),
        "leave_to_frozen": since(t_leave, last(evs, "round_frozen", 2)),
        "leave_to_last_join": since(t_leave, last(evs, "node_joined", 2)),
        "fanout": fanout(evs, 2),
        **sessions(evs, t_leave),
        **gc_pauses(done),
        **d,
        "leader": leader_cpu(evs, 2, th2, threads(pool, every), d["proc_cpu"], counts),
        "problems": check_infos(r2, n - 1, 2),
        "keepalive": ka,
    }
    if len(done) < len(every):
        out["problems"].append(
            f"{len(every) - len(done)} process(es) not done after {args.timeout + 30:g}s"
        )
    return out


def report(results: list[dict], args: argparse.Namespace) -> bool:
    """The table, the notes, the curve's fits; the JSON and the plot. True when all passed."""
    text, ok = table(results)
    print()
    print(text)
    for note in busy_notes(results) + target_lines() + fit_lines(results):
        print(note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    if args.svg:
        write_svg(results, args.svg)
        print(f"plot: {args.svg}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parsed = parse(argv, __doc__.split("\n\n")[0])
    if parsed is None:
        return 2
    args, ns, ms = parsed
    from etcdrun.rendezvous.localetcd import find_etcd

    if find_etcd() is None:
        print("etcd not found: set $ETCD_BIN or install etcd-server", file=sys.stderr)
        return 2
    print(
        f"{os.cpu_count()} CPU(s); one etcd per N (fast timings); handlers share "
        f"{f'one client per {args.per_client}' if args.per_client else 'one client per process'}; "
        f"times from time.time() across processes of this machine; "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    results = []
    for m in ms:
        for n in ns:
            t0 = time.monotonic()
            res = run_one(n, m, args.procs, args)
            res["wall_s"] = time.monotonic() - t0
            res["load"] = os.getloadavg()[0]
            results.append(res)
            print(details(res), f"\n  (wall {res['wall_s']:.1f}s, load {res['load']:.2f})")
            sys.stdout.flush()
    ok = report(results, args)
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
