#!/usr/bin/env python3
"""bench/client_latency.py's watch delivery, across two processes.

A separate putter process (bare stub, the same for both sides) stamps the time just before each
put into the value; the watcher subtracts it from the time its callback runs (CLOCK_MONOTONIC is
one clock for all processes of a machine), so the ratio isolates the watch path of the client.
Run as a module, this is the putter: ``python -m bench.latency_watch <target>`` (started by
``bench_watch`` with the repository root as its working directory, where ``bench`` is found).
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.latency_common import (
    EVENT_TIMEOUT,
    REQUEST_TIMEOUT,
    interleave_samples,
    now_ns,
    summarize,
)

ROOT = Path(__file__).resolve().parent.parent  # the putter runs as bench.latency_watch from here


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
            put(pb.PutRequest(key=key, value=str(now_ns()).encode()), timeout=REQUEST_TIMEOUT)
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


def _deliver(putter: subprocess.Popen, arrived: queue.Queue, key: bytes, watchers: tuple):
    """One timed sample: ask the putter to put ``key``; the watch's delivery latency."""

    def run() -> int:
        assert putter.stdin is not None
        putter.stdin.write(key.decode() + "\n")
        putter.stdin.flush()
        try:
            return arrived.get(timeout=EVENT_TIMEOUT)
        except queue.Empty:
            err = next((w.error for w in watchers if w.error), None) or "no event"
            raise RuntimeError(
                f"watch event for {key!r} not delivered within {EVENT_TIMEOUT} s: {err}"
            ) from None

    return run


def _start_putter(target: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.latency_watch", target],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _stop_putter(putter: subprocess.Popen) -> None:
    if putter.stdin is not None:
        putter.stdin.close()
    try:
        putter.wait(timeout=5)
    except subprocess.TimeoutExpired:
        putter.kill()
        putter.wait()


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
        arrived.put(now_ns() - int(value))

    putter = _start_putter(target)
    w_ours = client.watch(
        k_ours, start_revision=start_rev, callback=lambda b: [stamp(ev.kv.value) for ev in b.events]
    )
    w_bare = BareWatcher(channel, k_bare, start_rev, stamp)
    try:
        if not w_ours.created.wait(EVENT_TIMEOUT) or not w_bare.created.wait(EVENT_TIMEOUT):
            raise RuntimeError("watch not created within 5 s")
        assert putter.stdout is not None
        if putter.stdout.readline().strip() != "ready":
            raise RuntimeError(f"putter process failed (exit code {putter.poll()})")
        watchers = (w_ours, w_bare)
        run_ours = _deliver(putter, arrived, k_ours, watchers)
        run_bare = _deliver(putter, arrived, k_bare, watchers)
        return summarize(*interleave_samples(run_ours, run_bare, n, warmup, budget))
    finally:
        _stop_putter(putter)
        w_ours.cancel()
        w_bare.close()


if __name__ == "__main__":
    sys.exit(putter_main(sys.argv[1]))
