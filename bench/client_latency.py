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

Usage: ``python bench/client_latency.py [--n 2000] [--endpoints host:port] [--json out.json]``.
Without ``--endpoints`` it starts (and removes) its own single-member etcd on random ports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

TARGET = 1.2  # ours/bare p50 ratio the foundation issue asks for
REQUEST_TIMEOUT = 2.0  # the bare calls' deadline, the client's default request_timeout
EVENT_TIMEOUT = 5.0  # a watch event slower than this means the watch is broken: give up
OPS = ("put", "range", "txn", "keepalive", "watch")
_now = time.monotonic_ns  # CLOCK_MONOTONIC on Linux: comparable across processes


# ---- numbers ----------------------------------------------------------------------------------
def percentile(samples: list[int], q: float) -> float:
    """Nearest-rank percentile of nanosecond samples, in milliseconds."""
    s = sorted(samples)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k] / 1e6


def summarize(ours: list[int], bare: list[int]) -> dict:
    o50, b50 = percentile(ours, 50), percentile(bare, 50)
    ratio = o50 / b50 if b50 > 0 else float("inf")
    return {
        "ours": {"p50_ms": o50, "p90_ms": percentile(ours, 90), "samples": len(ours)},
        "bare": {"p50_ms": b50, "p90_ms": percentile(bare, 90), "samples": len(bare)},
        "ratio_p50": ratio,
        "pass": ratio <= TARGET,
    }


def interleave(
    ours: Callable[[], None], bare: Callable[[], None], n: int, warmup: int, budget: float
) -> tuple[list[int], list[int]]:
    """Time ``ours`` and ``bare`` alternately (the order flips every round); stop early when
    ``budget`` seconds are spent, so one slow operation cannot make the run unbounded."""
    t_ours: list[int] = []
    t_bare: list[int] = []
    deadline = time.monotonic() + budget
    for i in range(warmup + n):
        pair = ((ours, t_ours), (bare, t_bare)) if i % 2 == 0 else ((bare, t_bare), (ours, t_ours))
        for fn, out in pair:
            t0 = time.perf_counter_ns()
            fn()
            dt = time.perf_counter_ns() - t0
            if i >= warmup:
                out.append(dt)
        if i >= warmup + 10 and time.monotonic() > deadline:
            break
    return t_ours, t_bare


# ---- the unary operations and keep-alive ------------------------------------------------------
def bench_unary(client, channel, prefix: bytes, n: int, warmup: int, budget: float) -> dict:
    from etcdrun.proto import etcd_api_pb2 as pb
    from etcdrun.proto.etcd_stubs import bind
    from etcdrun.rendezvous.client import txn as t

    put_stub, range_stub = bind(channel, "Put"), bind(channel, "Range")
    txn_stub, ka_stub = bind(channel, "Txn"), bind(channel, "LeaseKeepAlive")
    k_ours, k_bare = prefix + b"kv/ours", prefix + b"kv/bare"
    value = b"x" * 64
    results = {}

    def put_ours() -> None:
        client.put(k_ours, value)

    def put_bare() -> None:
        put_stub(pb.PutRequest(key=k_bare, value=value), timeout=REQUEST_TIMEOUT)

    results["put"] = summarize(*interleave(put_ours, put_bare, n, warmup, budget))

    def range_ours() -> None:
        if not client.range(k_ours).kvs:
            raise RuntimeError("range (ours) found no key")

    def range_bare() -> None:
        if not range_stub(pb.RangeRequest(key=k_bare), timeout=REQUEST_TIMEOUT).kvs:
            raise RuntimeError("range (bare) found no key")

    results["range"] = summarize(*interleave(range_ours, range_bare, n, warmup, budget))

    # A fenced write, as the rendezvous does it: put only if nobody wrote since our last write.
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
        req = pb.TxnRequest(
            compare=[
                pb.Compare(
                    key=k_bare,
                    result=pb.Compare.EQUAL,
                    target=pb.Compare.MOD,
                    mod_revision=rev["bare"],
                )
            ],
            success=[pb.RequestOp(request_put=pb.PutRequest(key=k_bare, value=value))],
        )
        r = txn_stub(req, timeout=REQUEST_TIMEOUT)
        if not r.succeeded:
            raise RuntimeError("txn (bare) compare failed")
        rev["bare"] = r.header.revision

    results["txn"] = summarize(*interleave(txn_ours, txn_bare, n, warmup, budget))

    # Keep-alive: the keeper's own tick on a lease it does not otherwise keep alive (no
    # keeper thread racing us); its counter proves every tick was acknowledged.
    lease_ours = client.lease(60, keepalive=False)
    lease_bare = bind(channel, "LeaseGrant")(pb.LeaseGrantRequest(TTL=60), timeout=REQUEST_TIMEOUT)
    keeper = client._leases
    try:

        def ka_ours() -> None:
            keeper._tick([lease_ours])

        def ka_bare() -> None:
            call = ka_stub(
                iter([pb.LeaseKeepAliveRequest(ID=lease_bare.ID)]), timeout=REQUEST_TIMEOUT
            )
            for resp in call:
                if resp.TTL <= 0:
                    raise RuntimeError("keep-alive (bare): lease gone")
                call.cancel()
                break

        t_ours, t_bare = interleave(ka_ours, ka_bare, n, warmup, budget)
        ticks = len(t_ours) + warmup
        if lease_ours.keepalives != ticks or lease_ours.lost.is_set():
            raise RuntimeError(
                f"keep-alive (ours): {lease_ours.keepalives} of {ticks} ticks "
                f"acknowledged ({lease_ours.lost_reason or 'lease not lost'})"
            )
        results["keepalive"] = summarize(t_ours, t_bare)
    finally:
        # Lease.revoke() of a lease granted with keepalive=False does not reach the server (it
        # has no keeper to ask), so revoke through the keeper directly.
        keeper.revoke(lease_ours.id, timeout=REQUEST_TIMEOUT)
        bind(channel, "LeaseRevoke")(
            pb.LeaseRevokeRequest(ID=lease_bare.ID), timeout=REQUEST_TIMEOUT
        )
    return results


# ---- watch delivery across processes ----------------------------------------------------------
def putter_main(target: str) -> int:
    """The other process: on each line ``<key>`` from stdin, stamp the time and put it there."""
    import grpc

    from etcdrun.proto import etcd_api_pb2 as pb
    from etcdrun.proto.etcd_stubs import bind

    with grpc.insecure_channel(target) as ch:
        put = bind(ch, "Put")
        put(pb.PutRequest(key=b"/etcdrun-bench-warmup", value=b""), timeout=REQUEST_TIMEOUT)
        put(pb.PutRequest(key=b"/etcdrun-bench-warmup", value=b""), timeout=REQUEST_TIMEOUT)
        bind(ch, "DeleteRange")(
            pb.DeleteRangeRequest(key=b"/etcdrun-bench-warmup"), timeout=REQUEST_TIMEOUT
        )
        print("ready", flush=True)
        for line in sys.stdin:
            key = line.strip().encode()
            put(pb.PutRequest(key=key, value=str(_now()).encode()), timeout=REQUEST_TIMEOUT)
    return 0


class BareWatcher:
    """A watch on one key over the bare stub; one thread reads the stream (as our client's)."""

    def __init__(
        self, channel, key: bytes, start_revision: int, on_event: Callable[[bytes], None]
    ) -> None:
        from etcdrun.proto import etcd_api_pb2 as pb
        from etcdrun.proto.etcd_stubs import bind

        self._requests: queue.Queue = queue.Queue()
        self._requests.put(
            pb.WatchRequest(
                create_request=pb.WatchCreateRequest(key=key, start_revision=start_revision)
            )
        )
        self._call = bind(channel, "Watch")(self._iter())
        self._on_event = on_event
        self.created = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="bare-watch", daemon=True)
        self._thread.start()

    def _iter(self) -> Iterator:
        while (item := self._requests.get()) is not None:
            yield item

    def _run(self) -> None:
        import grpc

        try:
            for resp in self._call:
                if resp.created:
                    self.created.set()
                for ev in resp.events:
                    self._on_event(ev.kv.value)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        self._thread.join(timeout=5)


def bench_watch(
    client, channel, target: str, prefix: bytes, n: int, warmup: int, budget: float
) -> dict:
    from etcdrun.proto import etcd_api_pb2 as pb
    from etcdrun.proto.etcd_stubs import bind

    k_ours, k_bare = prefix + b"watch/ours", prefix + b"watch/bare"
    start = bind(channel, "Range")(pb.RangeRequest(key=prefix), timeout=REQUEST_TIMEOUT)
    start_rev = start.header.revision + 1
    arrived: queue.Queue = queue.Queue()

    def stamp(value: bytes) -> None:
        arrived.put(_now() - int(value))

    putter = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--_putter", target],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    w_ours = client.watch(
        k_ours, start_revision=start_rev, callback=lambda b: [stamp(ev.kv.value) for ev in b.events]
    )
    w_bare = BareWatcher(channel, k_bare, start_rev, stamp)
    try:
        if not w_ours.created.wait(EVENT_TIMEOUT) or not w_bare.created.wait(EVENT_TIMEOUT):
            raise RuntimeError("watch not created within 5 s")
        assert putter.stdout is not None and putter.stdin is not None
        if putter.stdout.readline().strip() != "ready":
            raise RuntimeError(f"putter process failed (exit code {putter.poll()})")

        def one(key: bytes) -> Callable[[], int]:
            def run() -> int:
                putter.stdin.write(key.decode() + "\n")
                putter.stdin.flush()
                try:
                    return arrived.get(timeout=EVENT_TIMEOUT)
                except queue.Empty:
                    err = w_ours.error or w_bare.error or "no event"
                    raise RuntimeError(
                        f"watch event for {key!r} not delivered within {EVENT_TIMEOUT} s: {err}"
                    ) from None

            return run

        t_ours: list[int] = []
        t_bare: list[int] = []
        deadline = time.monotonic() + budget
        run_ours, run_bare = one(k_ours), one(k_bare)
        for i in range(warmup + n):
            pair = (
                ((run_ours, t_ours), (run_bare, t_bare))
                if i % 2 == 0
                else ((run_bare, t_bare), (run_ours, t_ours))
            )
            for fn, out in pair:
                dt = fn()
                if i >= warmup:
                    out.append(dt)
            if i >= warmup + 10 and time.monotonic() > deadline:
                break
        return summarize(t_ours, t_bare)
    finally:
        if putter.stdin is not None:
            putter.stdin.close()
        try:
            putter.wait(timeout=5)
        except subprocess.TimeoutExpired:
            putter.kill()
            putter.wait()
        w_ours.cancel()
        w_bare.close()


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
    p.add_argument("--_putter", metavar="TARGET", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._putter:
        return putter_main(args._putter)
    if args.n < 10 or args.warmup < 0 or args.budget <= 0:
        print("client_latency: --n must be >= 10, --warmup >= 0, --budget > 0", file=sys.stderr)
        return 2
    from etcdrun.rendezvous.client import parse_endpoints

    if args.endpoints:
        try:
            eps = parse_endpoints(args.endpoints)
        except ValueError as e:
            print(f"client_latency: {e}", file=sys.stderr)
            return 2
        if any(ep.secure for ep in eps):
            print(
                "client_latency: TLS endpoints are not supported (plain http only)", file=sys.stderr
            )
            return 2
    started = time.monotonic()
    try:
        if args.endpoints:
            where = args.endpoints
            results = run(args.endpoints, args.n, args.warmup, args.budget)
        else:
            from etcdrun.rendezvous.localetcd import LocalEtcd

            with LocalEtcd() as etcd:
                where = f"local etcd {etcd.endpoints} ({etcd.etcd_bin}, fast timings)"
                results = run(etcd.endpoints, args.n, args.warmup, args.budget)
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
