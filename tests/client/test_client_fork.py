"""A client made before fork() works in the child while the parent's own threads use it.

The parent keeps a lease alive, a watch open and two threads making requests on one client, and
forks children one after another; each makes a request on the inherited client. Without the
fork gate (rendezvous/client/forks.py) a child now and then aborted in gRPC (SIGABRT) or hung on
a lock a parent's thread held when it forked; and a child's first call could meet a connection
gRPC closed at the fork, which is worth another attempt. bench/fork_safety.py runs the long
version.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest

from bench.fork_safety import reap
from etcdrun.rendezvous.client import EtcdClient

FORKS = 50
HANG_S = 10.0  # a child's one request takes milliseconds; this long is a deadlock


def _outcome(pid: int) -> str:
    """How the child ended (ok, error, abort, signal ..., hung): the benchmark's own reading."""
    return reap(pid, HANG_S)


def _fork_one_request(client: EtcdClient, key: str) -> int:
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            code = 0 if client.get(key) is not None else 2
        finally:
            os._exit(code)
    return pid


@pytest.fixture
def busy_client(etcd) -> Iterator[EtcdClient]:
    """A client with a kept-alive lease, an open watch and two threads making requests."""
    client = EtcdClient(etcd.endpoints)
    stop = threading.Event()

    def requests() -> None:
        while not stop.is_set():
            client.get("/fork/key")

    threads = [threading.Thread(target=requests, name=f"busy-{i}") for i in range(2)]
    try:
        client.put("/fork/key", b"x")  # not leased: a late keep-alive is not what is tested
        client.lease(1)  # a keep-alive every 1/3 s
        client.watch("/fork/key", callback=lambda batch: None)
        for t in threads:
            t.start()
        yield client
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join()
        client.close()


def test_children_forked_while_the_parent_uses_the_client_all_work(busy_client):
    outcomes = Counter(_outcome(_fork_one_request(busy_client, "/fork/key")) for _ in range(FORKS))
    assert outcomes == {"ok": FORKS}


def test_a_watch_goes_on_across_a_fork_without_losing_an_event(etcd):
    """A fork cancels the watch stream and reopens it after: no event lost, and not counted as
    a broken stream (no reconnect, no failover).
    """
    with EtcdClient(etcd.endpoints) as client:
        events: queue.Queue = queue.Queue()
        start = client.range("/fork/w").revision + 1  # nothing put from here on is missed
        client.watch("/fork/w", prefix=True, start_revision=start, callback=events.put)
        client.put("/fork/w/before", b"1")
        assert [e.kv.key for e in events.get(timeout=10).events] == [b"/fork/w/before"]
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        client.put("/fork/w/after", b"2")  # whether before or after the reopen: delivered
        assert [e.kv.key for e in events.get(timeout=10).events] == [b"/fork/w/after"]
        assert _outcome(pid) == "ok"
        assert client.watch_reconnects == 0


def test_a_fork_from_a_watch_callback_does_not_wait_for_itself(etcd):
    """The callback runs inside the watch stream's call: the fork must not wait for it."""
    with EtcdClient(etcd.endpoints) as client:
        children: queue.Queue = queue.Queue()

        def fork_child(batch) -> None:
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            children.put(pid)

        start = client.range("/fork/cb").revision + 1
        client.watch("/fork/cb", start_revision=start, callback=fork_child)
        client.put("/fork/cb", b"go")
        pid = children.get(timeout=10)  # forked at once, not after the gate's drain limit
        assert _outcome(pid) == "ok"
        assert client.get("/fork/cb").value == b"go"  # the parent's client still works


class _ClosedOnFork(grpc.RpcError):
    """What a child's first call met once in 2000 forks: a connection gRPC closed at the fork."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNKNOWN

    def details(self) -> str:
        return "Stream removed (Closed on fork)"


def test_a_connection_closed_on_fork_is_retried(etcd, monkeypatch):
    from etcdrun.rendezvous.client import transport

    real = transport.bind
    failed: list[str] = []

    def bind(channel, name):
        call = real(channel, name)

        def first_fails(*args, **kwargs):
            if not failed:
                failed.append(name)
                raise _ClosedOnFork()
            return call(*args, **kwargs)

        return first_fails

    with EtcdClient(etcd.endpoints) as client:
        monkeypatch.setattr(transport, "bind", bind)
        client.put("/fork/retried", b"1")  # the first attempt fails as after a fork
        assert failed == ["Put"] and client.get("/fork/retried").value == b"1"
