"""The etcd client against a real etcd: KV, Txn, leases, watches, fork, clean close."""

from __future__ import annotations

import os
import threading
import time

import pytest
from etcd_helpers import assert_no_leases

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import (
    EtcdClient,
    EtcdClosedError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdLeaseNotFoundError,
    parse_endpoints,
)
from etcdrun.rendezvous.client import txn as t


@pytest.fixture
def client(etcd):
    c = EtcdClient(etcd.endpoints)
    yield c
    c.close()


def test_parse_endpoints():
    eps = parse_endpoints("a:1, https://b , http://[::1]:3")
    assert [(e.host, e.port, e.secure) for e in eps] == [
        ("a", 1, None),
        ("b", 2379, True),
        ("::1", 3, False),
    ]
    for bad in ["", "a:b", "a:99999", "ftp://x", "a b", "-1", "-1:2379", "a..b", "etcd-.x"]:
        with pytest.raises(ValueError):
            parse_endpoints(bad)


def test_put_get_range_delete(client):
    r1 = client.put("/t/a", b"1")
    client.put("/t/b", "2")
    client.put("/tt", b"x")
    kv = client.get("/t/a")
    assert kv.value == b"1" and kv.create_revision == r1 and kv.version == 1
    res = client.get_prefix("/t/")
    assert [k.key for k in res.kvs] == [b"/t/a", b"/t/b"] and res.revision >= r1 + 2
    assert client.range("/t/", prefix=True, count_only=True).count == 2
    assert client.get("/missing") is None
    assert client.delete("/t/", prefix=True) == 2
    assert client.get("/tt").value == b"x"


def test_txn_fenced_on_mod_revision(client):
    rev = client.put("/k", b"v1")
    ok = client.txn([t.mod_revision("/k", "==", rev)], [t.put("/k", b"v2")], [t.get("/k")])
    assert ok.succeeded
    stale = client.txn([t.mod_revision("/k", "==", rev)], [t.put("/k", b"v3")], [t.get("/k")])
    assert not stale.succeeded
    assert stale.responses[0].response_range.kvs[0].value == b"v2"
    created = client.txn([t.create_revision("/new", "==", 0)], [t.put("/new", b"x")])
    again = client.txn([t.create_revision("/new", "==", 0)], [t.put("/new", b"y")])
    assert created.succeeded and not again.succeeded
    assert t.prefix_end(b"a\xff") == b"b" and t.prefix_end(b"\xff") == b"\0"


def test_lease_kept_alive_for_10s_with_ttl_2(client):
    lease = client.lease(2)
    client.put("/leased", b"x", lease=lease)
    time.sleep(10)
    assert not lease.lost.is_set()
    assert client.get("/leased") is not None
    assert lease.keepalives >= 10  # every ttl/3
    assert client.lease_ttl(lease).TTL > 0
    assert lease.revoke()
    assert client.get("/leased") is None
    assert lease.lost.is_set()


def test_lease_not_kept_alive_expires_and_is_reported(client):
    lease = client.lease(1, keepalive=False)
    client.put("/short", b"x", lease=lease)
    deadline = time.monotonic() + 5
    while client.get("/short") is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.get("/short") is None
    with pytest.raises(EtcdLeaseNotFoundError):
        client.put("/again", b"x", lease=lease)


def test_lease_revoked_elsewhere_is_marked_lost(client, etcd):
    lease = client.lease(3)
    other = EtcdClient(etcd.endpoints)
    try:
        other._t.call("LeaseRevoke", pb.LeaseRevokeRequest(ID=lease.id))
    finally:
        other.close()
    assert lease.lost.wait(3)  # the next keep-alive answers TTL <= 0
    assert "expired" in lease.lost_reason


def test_watch_from_revision_delivers_every_event_once(client):
    rev = client.put("/w/0", b"0")
    for i in range(1, 6):
        client.put(f"/w/{i}", str(i).encode())
    w = client.watch("/w/", prefix=True, start_revision=rev + 1)
    client.delete("/w/1")
    got = []
    while len(got) < 6:
        batch = w.get(timeout=5)
        assert batch is not None, got
        got += [(e.type, e.kv.key) for e in batch.events]
    assert got == [(pb.Event.PUT, f"/w/{i}".encode()) for i in range(1, 6)] + [
        (pb.Event.DELETE, b"/w/1")
    ]
    w.cancel()
    assert w.get(timeout=0.2) is None


def test_watch_callback_and_many_watches_share_one_stream(client):
    seen: dict[int, list] = {i: [] for i in range(20)}
    done = threading.Event()

    def cb(i):
        def f(batch):
            seen[i].extend(e.kv.value for e in batch.events)
            if all(seen.values()):
                done.set()

        return f

    rev = client.put("/cb", b"-")
    ws = [client.watch(f"/cb/{i}", start_revision=rev + 1, callback=cb(i)) for i in range(20)]
    for i in range(20):
        client.put(f"/cb/{i}", str(i).encode())
    assert done.wait(5)
    assert seen == {i: [str(i).encode()] for i in range(20)}
    assert len([th for th in threading.enumerate() if th.name == "etcd-watch"]) == 1
    for w in ws:
        w.cancel()


def test_compacted_watch_is_an_error(client):
    first = client.put("/c", b"1")
    for i in range(5):
        last = client.put("/c", str(i).encode())
    client.compact(last)
    w = client.watch("/c", start_revision=first)
    with pytest.raises(EtcdCompactedError) as err:
        w.get(timeout=5)
    assert err.value.compact_revision == last
    with pytest.raises(EtcdCompactedError):
        client.range("/c", revision=first)


def test_close_is_clean_and_revokes_leases(etcd):
    c = EtcdClient(etcd.endpoints)
    lease = c.lease(5)
    c.put("/x", b"1", lease=lease)
    w = c.watch("/x", start_revision=1)
    assert w.get(timeout=5) is not None
    before = time.monotonic()
    c.close()
    assert time.monotonic() - before < 2
    assert not [th for th in threading.enumerate() if th.name.startswith("etcd-")]
    assert_no_leases(etcd.endpoints)
    with pytest.raises(EtcdClosedError):
        c.put("/x", b"2")
    c.close()  # idempotent


def test_unreachable_endpoint_is_a_connection_error_within_budget():
    c = EtcdClient("127.0.0.1:1", request_timeout=0.2, retry_timeout=1.0)
    start = time.monotonic()
    with pytest.raises(EtcdConnectionError) as err:
        c.put("/x", b"1")
    c.close()
    assert "127.0.0.1:1" in str(err.value)
    assert time.monotonic() - start < 3


def test_failover_skips_a_dead_endpoint(etcd):
    c = EtcdClient(f"127.0.0.1:1,{etcd.endpoints}", request_timeout=0.5, retry_timeout=5)
    try:
        c.put("/f", b"1")
        assert c.get("/f").value == b"1"
        assert c._t.preferred() == 1
    finally:
        c.close()


def test_client_made_before_fork_works_in_child(client):
    client.put("/fork", b"parent")
    pid = os.fork()
    if pid == 0:  # child: prove the client works here, report by exit code
        code = 1
        try:
            code = 0 if client.get("/fork").value == b"parent" else 2
            client.put("/fork", b"child")
        except BaseException:
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.get("/fork").value == b"child"  # and the parent's channel still works
