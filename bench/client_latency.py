#!/usr/bin/env python3
"""Latency of etcdrun's etcd client against a bare generated-stub call, per operation.

Why this benchmark: the rendezvous sits on top of EtcdClient, and the client adds failover,
retry, typed errors, auth and fencing around every call. This measures what that costs per call
(target: p50 within 1.2x of a bare call with the same generated messages on a plain channel), so a
slow layer is seen as a number and not as a vague "rendezvous feels slow".

How it stays fair:
- Ours and bare run interleaved, one call each, alternating which goes first, so drift of the
  machine or of etcd (WAL fsync, compaction, another process) hits both sides alike.
- Both sides build their request messages inside the timed region (our client builds them
  inside ``put()``; a caller of the bare stub must too). The bare stub is bound once, as a
  generated stub is bound in its constructor.
- Lease keep-alive runs the keeper's own tick (one LeaseKeepAlive stream, one request, one
  answer), exactly what the keeper thread does every TTL/3.
- Watch delivery: a separate putter process (bare stub, the same for both sides) stamps the time
  just before each put into the value; the watcher here subtracts it from the time its callback
  runs (CLOCK_MONOTONIC is one clock for all processes on a machine). So the ratio isolates the
  watch path of the client.

Usage: ``python -m bench.client_latency [--n 2000] [--endpoints host:port] [--json out.json]``.
Without ``--endpoints`` it starts (and removes) its own single-member etcd on random ports.
The timing loop and verdict are in latency_common.py, the watch side (and the putter process)
in latency_watch.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid

from bench.latency_common import REQUEST_TIMEOUT, TARGET, interleave, summarize
from bench.latency_watch import bench_watch

OPS = ("put", "range", "txn", "keepalive", "watch")


# ---- the unary operations and keep-alive ------------------------------------------------------
def bench_put_range(client, channel, prefix: bytes, n: int, warmup: int, budget: float) -> dict:
    from etcdrun.proto import etcd_api_pb2 as pb
    from etcdrun.proto.etcd_stubs import bind

    put_stub, range_stub = bind(channel, "Put"), bind(channel, "Range")
    k_ours, k_bare = prefix + b"kv/ours", prefix + b"kv/bare"
    value = b"x" * 64

    def put_ours() -> None:
        client.put(k_ours, value)

    def put_bare() -> None:
        put_stub(pb.PutRequest(key=k_bare, value=value), timeout=REQUEST_TIMEOUT)

    def range_ours() -> None:
        if not client.range(k_ours).kvs:
            raise RuntimeError("range (ours) found no key")

    def range_bare() -> None:
        if not range_stub(pb.RangeRequest(key=k_bare), timeout=REQUEST_TIMEOUT).kvs:
            raise RuntimeError("range (bare) found no key")

    return {
        "put": summarize(*interleave(put_ours, put_bare, n, warmup, budget)),
        "range": summarize(*interleave(range_ours, range_bare, n, warmup, budget)),
    }


def bench_txn(client, channel, prefix: bytes, n: int, warmup: int, budget: float) -> dict:
    """A fenced write, as the rendezvous does it: put only if nobody wrote since our last."""
    from etcdrun.proto import etcd_api_pb2 as pb
    from etcdrun.proto.etcd_stubs import bind
    from etcdrun.rendezvous.client import txn as t

    txn_stub = bind(channel, "Txn")
    k_ours, k_bare = prefix + b"kv/ours", prefix + b"kv/bare"  # written by bench_put_range
    value = b"x" * 64
    rev = {
        "ours": client.range(k_ours).kvs[0].mod_revision,
        "bare": client.range(k_bare).kvs[0].mod_revision,
    }

    def txn_ours() -> None:
        r = client.txn([t.mod_revision(k_ours, "==", rev["ours"])], [t.put(k_ours, value)])
        if not r.succeeded:
            raise RuntimeError("txn (ours) compare failed")
        rev["ours"] = r.revision

    def txn_bare() -> None:
        cmp = pb.Compare(
            key=k_bare, result=pb.Compare.EQUAL, target=pb.Compare.MOD, mod_revision=rev["bare"]
        )
        put = pb.RequestOp(request_put=pb.PutRequest(key=k_bare, value=value))
        r = txn_stub(pb.TxnRequest(compare=[cmp], success=[put]), timeout=REQUEST_TIMEOUT)
        if not r.succeeded:
            raise RuntimeError("txn (bare) compare failed")
        rev["bare"] = r.header.revision

    return summarize(*interleave(txn_ours, txn_bare, n, warmup, budget))


def bench_keepalive(client, channel, n: int, warmup: int, budget: float) -> dict:
    """The keeper's own tick on a lease it does not otherwise keep alive (no keeper thread
    racing us); its counter proves every tick was acknowledged.
    """
    from etcdrun.proto import etcd_api_pb2 as pb
    from etcdrun.proto.etcd_stubs import bind

    ka_stub = bind(channel, "LeaseKeepAlive")
    lease_ours = client.lease(60, keepalive=False)
    lease_bare = bind(channel, "LeaseGrant")(pb.LeaseGrantRequest(TTL=60), timeout=REQUEST_TIMEOUT)
    keeper = client._leases

    def ka_ours() -> None:
        keeper._tick([lease_ours])

    def ka_bare() -> None:
        call = ka_stub(iter([pb.LeaseKeepAliveRequest(ID=lease_bare.ID)]), timeout=REQUEST_TIMEOUT)
        for resp in call:
            if resp.TTL <= 0:
                raise RuntimeError("keep-alive (bare): lease gone")
            call.cancel()
            break

    try:
        t_ours, t_bare = interleave(ka_ours, ka_bare, n, warmup, budget)
        ticks = len(t_ours) + warmup
        if lease_ours.keepalives != ticks or lease_ours.lost.is_set():
            raise RuntimeError(
                f"keep-alive (ours): {lease_ours.keepalives} of {ticks} ticks "
                f"acknowledged ({lease_ours.lost_reason or 'lease not lost'})"
            )
        return summarize(t_ours, t_bare)
    finally:
        # Lease.revoke() of a lease granted with keepalive=False does not reach the server (it
        # has no keeper to ask), so revoke through the keeper directly.
        keeper.revoke(lease_ours.id, timeout=REQUEST_TIMEOUT)
        bind(channel, "LeaseRevoke")(
            pb.LeaseRevokeRequest(ID=lease_bare.ID), timeout=REQUEST_TIMEOUT
        )


def bench_unary(client, channel, prefix: bytes, n: int, warmup: int, budget: float) -> dict:
    results = bench_put_range(client, channel, prefix, n, warmup, budget)
    results["txn"] = bench_txn(client, channel, prefix, n, warmup, budget)
    results["keepalive"] = bench_keepalive(client, channel, n, warmup, budget)
    return results


# ---- driver -----------------------------------------------------------------------------------
def run(endpoints: str, n: int, warmup: int, budget: float) -> dict:
    import grpc

    from etcdrun.proto import etcd_api_pb2 as pb
    from etcdrun.proto.etcd_stubs import bind
    from etcdrun.rendezvous.client import EtcdClient, parse_endpoints

    target = parse_endpoints(endpoints)[0].target
    prefix = f"/etcdrun-bench/{uuid.uuid4().hex[:8]}/".encode()
    per_op = budget / len(OPS)
    channel = grpc.insecure_channel(target)
    try:  # fail in a second with one line, not after the client's 30 s of retries
        bind(channel, "Status")(pb.StatusRequest(), timeout=REQUEST_TIMEOUT)
    except grpc.RpcError as e:
        channel.close()
        raise RuntimeError(
            f"etcd at {target} does not answer: {e.code().name} ({e.details()})"
        ) from None
    client = EtcdClient(endpoints)
    try:
        results = bench_unary(client, channel, prefix, n, warmup, per_op)
        results["watch"] = bench_watch(client, channel, target, prefix, n, warmup, per_op)
        bind(channel, "DeleteRange")(
            pb.DeleteRangeRequest(key=prefix, range_end=prefix[:-1] + b"0"), timeout=REQUEST_TIMEOUT
        )
    finally:
        client.close()
        channel.close()
    return results


def print_table(results: dict) -> None:
    labels = {
        "put": "put",
        "range": "range",
        "txn": "txn (cmp+put)",
        "keepalive": "lease keep-alive",
        "watch": "watch delivery",
    }
    head = (
        f"{'operation':<17}{'ours p50':>9}{'p90':>8}{'bare p50':>10}{'p90':>8}"
        f"{'ours/bare':>11}{'n':>7}  target {TARGET}x"
    )
    print(head)
    print("-" * len(head))
    for op in OPS:
        r = results[op]
        o, b = r["ours"], r["bare"]
        verdict = "PASS" if r["pass"] else "MISS"
        print(
            f"{labels[op]:<17}{o['p50_ms']:>9.3f}{o['p90_ms']:>8.3f}{b['p50_ms']:>10.3f}"
            f"{b['p90_ms']:>8.3f}{r['ratio_p50']:>10.2f}x{o['samples']:>7}  {verdict}"
        )
    print("(milliseconds; ratio of the p50s; n = timed calls per side, after warm-up)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--n", type=int, default=2000, help="timed calls per operation and side")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls first (default 200)")
    p.add_argument(
        "--endpoints",
        help="use this etcd (host:port[,...], plain http) instead of starting a local one",
    )
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    p.add_argument(
        "--budget",
        type=float,
        default=45.0,
        help="seconds for all timing loops together; an operation that runs out "
        "of its share stops early with fewer samples (default 45)",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when any operation misses")
    return p.parse_args(argv)


def bad_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, in one line; None when nothing is."""
    if args.n < 10 or args.warmup < 0 or args.budget <= 0:
        return "--n must be >= 10, --warmup >= 0, --budget > 0"
    if not args.endpoints:
        return None
    from etcdrun.rendezvous.client import parse_endpoints

    try:
        eps = parse_endpoints(args.endpoints)
    except ValueError as e:
        return str(e)
    if any(ep.secure for ep in eps):
        return "TLS endpoints are not supported (plain http only)"
    return None


def measure(args: argparse.Namespace) -> tuple[str, dict]:
    """(where, results): against --endpoints, or a local etcd started and removed here."""
    if args.endpoints:
        return args.endpoints, run(args.endpoints, args.n, args.warmup, args.budget)
    from etcdrun.rendezvous.localetcd import LocalEtcd

    with LocalEtcd() as etcd:
        where = f"local etcd {etcd.endpoints} ({etcd.etcd_bin}, fast timings)"
        return where, run(etcd.endpoints, args.n, args.warmup, args.budget)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = bad_arguments(args)
    if problem:
        print(f"client_latency: {problem}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        where, results = measure(args)
    except KeyboardInterrupt:  # everything started is already stopped by the finally blocks
        print("client_latency: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, OSError) as e:
        print(f"client_latency: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the client's typed errors: unreachable etcd and friends
        from etcdrun.rendezvous.client import EtcdError

        if not isinstance(e, EtcdError):
            raise
        print(f"client_latency: {e}", file=sys.stderr)
        return 1
    print(
        f"etcd client latency: {where}; Python {platform.python_version()}, "
        f"{os.cpu_count()} cores, {time.monotonic() - started:.1f} s"
    )
    print_table(results)
    if args.json:
        doc = {
            "target_ratio": TARGET,
            "n": args.n,
            "warmup": args.warmup,
            "etcd": where,
            "python": platform.python_version(),
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    missed = [op for op in OPS if not results[op]["pass"]]
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
