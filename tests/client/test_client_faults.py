"""The client through etcd failures: leader kill -9 under traffic, restart with an open watch."""

from __future__ import annotations

import threading
import time

from etcd_helpers import require_local

from etcdrun.rendezvous.client import EtcdClient


def test_leader_kill_during_traffic_recovers_within_deadline_plus_election(etcd_cluster):
    """Writes keep succeeding across a leader kill -9; the worst stall is bounded by one request
    deadline plus an election, not by grpc's default (infinite) wait.
    """
    c = EtcdClient(etcd_cluster.endpoints, request_timeout=1.0, retry_timeout=20)
    stop = threading.Event()
    stalls: list[float] = []
    errors: list[BaseException] = []
    written: list[int] = []

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                c.put("/traffic", str(i).encode())
                written.append(i)
            except BaseException as e:  # any error fails the test
                errors.append(e)
                return
            stalls.append(time.monotonic() - t0)
            i += 1

    th = threading.Thread(target=traffic)
    th.start()
    try:
        time.sleep(0.5)
        leader = etcd_cluster.leader()
        leader.kill()
        time.sleep(3)
    finally:
        stop.set()
        th.join()
    try:
        assert not errors, errors
        before = len(written)
        assert before > 50
        assert max(stalls) < 1.0 + 1.5, f"worst stall {max(stalls):.2f}s"
        assert int(c.get("/traffic").value) == written[-1]
    finally:
        c.close()
        leader.restart()


def test_watch_survives_etcd_restart_without_loss_or_duplicates(etcd):
    local = require_local(etcd)
    c = EtcdClient(local.endpoints, request_timeout=1.0, retry_timeout=20)
    got: list[int] = []
    try:
        rev = c.put("/r/0", b"0")
        w = c.watch("/r/", prefix=True, start_revision=rev + 1)
        for i in range(1, 50):
            c.put(f"/r/{i}", str(i).encode())
        local.members[0].kill()
        local.members[0].restart()
        for i in range(50, 100):
            c.put(f"/r/{i}", str(i).encode())
        deadline = time.monotonic() + 10
        while len(got) < 99 and time.monotonic() < deadline:
            batch = w.get(timeout=1)
            if batch:
                got.extend(int(e.kv.value) for e in batch.events)
        assert got == list(range(1, 100))
        assert c.watch_reconnects >= 1
        w.cancel()
    finally:
        c.close()


def test_watch_on_member_that_dies_moves_to_another(etcd_cluster):
    """The watch stream sits on one member; kill it and the watch resumes elsewhere."""
    first = etcd_cluster.members[0]
    others = [m.endpoint for m in etcd_cluster.members[1:]]
    c = EtcdClient([first.endpoint, *others], request_timeout=1.0, retry_timeout=20)
    try:
        rev = c.put("/m", b"0")
        w = c.watch("/m", start_revision=rev + 1)
        c.put("/m", b"1")
        assert [e.kv.value for e in w.get(timeout=5).events] == [b"1"]
        first.kill()
        c.put("/m", b"2")
        batch = w.get(timeout=10)
        assert batch is not None and [e.kv.value for e in batch.events] == [b"2"]
        w.cancel()
    finally:
        c.close()
        first.restart()
