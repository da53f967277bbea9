"""EtcdStore (rendezvous/torch/store.py) against torch's own expectations, on a real etcd.

The reference is torch itself: the same operations run on torch's HashStore and on ours and
must answer alike; gloo's ``init_process_group(store=...)`` and torch's elastic store utilities
(the barrier and synchronize torchrun's agent runs) go through it on three real processes.
"""

from __future__ import annotations

import datetime
import gc
import json
import re
import subprocess
import sys
import threading
import urllib.request
import uuid
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from agent_helpers import SCRIPTS
from layout import ROOT

from etcdrun.rendezvous.client import EtcdClient

MS = datetime.timedelta(milliseconds=1)


@pytest.fixture
def client(etcd, torch_available) -> Iterator[EtcdClient]:
    c = EtcdClient(etcd.endpoints)
    yield c
    c.close()


def _store(client: EtcdClient, lease: int = 0, timeout: datetime.timedelta | None = None):
    from etcdrun.rendezvous.torch.store import EtcdStore

    return EtcdStore(client, f"/t/{uuid.uuid4().hex[:8]}/store/", lease=lease, timeout=timeout)


def _script(s: Any) -> list[tuple[str, Any]]:
    """A fixed sequence of store calls; each answer, or the exception's class name."""
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("compare_set missing, expected x", lambda: s.compare_set("a", "x", "y")),
        ("compare_set missing, expected empty", lambda: s.compare_set("a", "", "y")),
        ("compare_set equal", lambda: s.compare_set("a", "y", "z")),
        ("compare_set different", lambda: s.compare_set("a", "q", "w")),
        ("get", lambda: s.get("a")),
        ("add new", lambda: s.add("c", 2)),
        ("add", lambda: s.add("c", 5)),
        ("add negative", lambda: s.add("c", -1)),
        ("get a counter", lambda: s.get("c")),
        ("add to text", lambda: s.add("a", 1)),
        ("append", lambda: (s.append("p", "ab"), s.append("p", b"cd"), s.get("p"))[2]),
        ("num_keys", lambda: s.num_keys()),
        ("delete_key", lambda: s.delete_key("p")),
        ("delete_key missing", lambda: s.delete_key("p")),
        ("check", lambda: s.check(["a", "c"])),
        ("check missing", lambda: s.check(["a", "zz"])),
        ("multi_get", lambda: s.multi_get(["c", "a"])),
        ("multi_set", lambda: (s.multi_set(["m1", "m2"], ["1", b"2"]), s.multi_get(["m2", "m1"]))),
        ("empty value", lambda: (s.set("e", ""), s.get("e"), s.compare_set("e", "", "v"))),
        ("binary value", lambda: (s.set("b", b"\x00\xff"), s.get("b"))),
        ("wait present", lambda: s.wait(["a", "c"])),
        ("wait timeout", lambda: s.wait(["nope"], 50 * MS)),
        ("get timeout", lambda: (s.set_timeout(100 * MS), s.get("nope"))),
        ("num_keys at the end", lambda: s.num_keys()),
        ("list_keys", lambda: sorted(s.list_keys())),
        ("has_extended_api", lambda: s.has_extended_api()),
        ("queue_len empty", lambda: s.queue_len("q")),
        ("queue_pop empty, not blocking", lambda: s.queue_pop("q", False)),
        ("check an empty queue", lambda: s.check(["q"])),
        ("queue_push", lambda: [s.queue_push("q", v) for v in ("1", b"2", "")]),
        ("queue_len", lambda: s.queue_len("q")),
        ("queues are not keys", lambda: (s.num_keys(), sorted(s.list_keys()))),
        ("check a queue", lambda: s.check(["q"])),
        ("wait on a queue", lambda: s.wait(["q"], 50 * MS)),
        ("get of a queue", lambda: s.get("q")),
        ("queue_pop, first in first out", lambda: [s.queue_pop("q") for _ in range(3)]),
        ("queue_pop timeout", lambda: s.queue_pop("q")),
        ("a key and a queue of one name", lambda: (s.queue_push("a", "x"), s.get("a"))),
        ("delete_key leaves the queue", lambda: (s.delete_key("a"), s.queue_len("a"))),
    ]
    out = []
    for name, fn in steps:
        try:
            out.append((name, fn()))
        except Exception as e:
            out.append((name, type(e).__name__))
    return out


def test_answers_like_torchs_hashstore(client):
    import torch.distributed as dist

    ours, torchs = _script(_store(client)), _script(dist.HashStore())
    assert ours == torchs
    assert dict(ours)["wait timeout"] == "DistStoreError"  # the reference did time out


def test_torchs_own_python_store_test_through_the_trampoline(client):
    """torch's C++ test of a Python store clones it and calls the clone from C++; torch wraps
    every store in a PrefixStore, whose clone() clones the store under it.
    """
    import torch.distributed as dist

    s = _store(client)
    dist._test_python_store(s)
    dist._test_python_store(dist.PrefixStore("p", s))
    assert dist.PrefixStore("p", s).has_extended_api()  # torch's extended-API tests run
    twin = dist.PrefixStore("pg", s).clone()  # only C++ holds the EtcdStore under it
    gc.collect()
    twin.set("k", b"v")
    assert (twin.get("k"), s.get("pg/k")) == (b"v", b"v")


def test_a_store_only_cpp_holds_lives_until_its_client_closes(etcd, torch_available):
    import torch.distributed as dist

    from etcdrun.rendezvous.torch.store import EtcdStore

    c = EtcdClient(etcd.endpoints)
    inline = dist.PrefixStore("p", EtcdStore(c, f"/t/{uuid.uuid4().hex[:8]}/"))
    gc.collect()
    inline.set("k", b"v")  # the EtcdStore written inline is still there for C++
    assert inline.get("k") == b"v"
    kept = weakref.ref(inline.underlying_store)
    c.close()
    with EtcdClient(etcd.endpoints) as other:
        EtcdStore(other, "/t/other/")  # a new store lets go of those of closed clients
    del inline
    gc.collect()
    assert kept() is None


def test_a_clone_has_its_own_timeout(client):
    s = _store(client, timeout=datetime.timedelta(seconds=7))
    twin = s.clone()
    twin.set_timeout(datetime.timedelta(seconds=1))
    assert (twin.timeout, s.timeout) == (
        datetime.timedelta(seconds=1),
        datetime.timedelta(seconds=7),
    )
    s.set("k", b"v")
    assert twin.get("k") == b"v"


def test_torchs_store_checks_of_the_extended_api_and_queues(client):
    """The checks torch's StoreTestBase makes of append/multi_get/multi_set (which it skips
    when has_extended_api() is False) and of the queues, on EtcdStore.
    """
    import torch.distributed as dist

    s = _store(client, timeout=datetime.timedelta(seconds=30))
    assert s.has_extended_api()
    s.set("foo", "po")
    s.append("foo", "tato")
    s.multi_set(["x", "y"], ["po", "tato"])
    assert (s.get("foo"), s.multi_get(["x", "y"])) == (b"potato", [b"po", b"tato"])
    assert not s.check(["q"]) and s.queue_len("q") == 0
    s.queue_push("q", "1")
    s.queue_push("q", "2")
    assert s.check(["q"]) and s.queue_len("q") == 2
    s.wait(["q"])
    assert [s.queue_pop("q"), s.queue_pop("q", block=False)] == [b"1", b"2"]
    with pytest.raises(dist.QueueEmptyError, match="empty"):
        s.queue_pop("q", block=False)

    def a() -> bytes:  # each thread on its own clone, as torch's test does
        mine = s.clone()
        mine.queue_push("a", "a1")
        return mine.queue_pop("b")

    def b() -> bytes:
        mine = s.clone()
        got = mine.queue_pop("a")
        mine.queue_push("b", "b1")
        return got

    with ThreadPoolExecutor(max_workers=2) as pool:
        assert [f.result(60) for f in [pool.submit(a), pool.submit(b)]] == [b"b1", b"a1"]
    s.set_timeout(datetime.timedelta(milliseconds=10))
    with pytest.raises(dist.DistStoreError, match="timeout"):
        s.queue_pop("never")


def test_each_item_is_popped_once_by_concurrent_nodes(etcd, client):
    """Two nodes pop one queue at once: every item comes out exactly once (the delete is
    fenced on the item's create_revision).
    """
    import torch.distributed as dist

    from etcdrun.rendezvous.torch.store import EtcdStore

    s = _store(client, timeout=datetime.timedelta(seconds=30))
    items = [str(i).encode() for i in range(40)]
    for item in items:
        s.queue_push("work", item)
    clients = [EtcdClient(etcd.endpoints) for _ in range(2)]
    try:

        def drain(c: EtcdClient) -> list[bytes]:
            mine = EtcdStore(c, s.prefix)
            got = []
            while mine.queue_len("work"):
                try:
                    got.append(mine.queue_pop("work", block=False))
                except dist.QueueEmptyError:
                    break  # the other node took the last one
            return got

        with ThreadPoolExecutor(max_workers=2) as pool:
            got = [f.result(60) for f in [pool.submit(drain, c) for c in clients]]
    finally:
        for c in clients:
            c.close()
    assert sorted(got[0] + got[1], key=int) == items
    assert got[0] == sorted(got[0], key=int) and got[1] == sorted(got[1], key=int)


def test_a_blocked_pop_and_a_wait_wake_on_another_nodes_push(etcd, client):
    from etcdrun.rendezvous.torch.store import EtcdStore

    s = _store(client, timeout=datetime.timedelta(seconds=30))
    with EtcdClient(etcd.endpoints) as other, ThreadPoolExecutor(max_workers=2) as pool:
        theirs = EtcdStore(other, s.prefix)
        waited = pool.submit(s.wait, ["jobs"])
        popped = pool.submit(s.clone().queue_pop, "jobs")
        theirs.queue_push("jobs", b"one")
        assert popped.result(30) == b"one"
        assert waited.result(30) is None


def test_cpp_callers_reach_it_through_a_prefix_store(client):
    """torch's C++ side calls the trampoline by C++ names (getNumKeys, deleteKey)."""
    import torch.distributed as dist

    s = _store(client)
    p = dist.PrefixStore("pg", s)  # keys "pg/<key>"
    p.set("k", b"v")
    assert (p.get("k"), p.add("n", 3), p.num_keys(), p.check(["k"])) == (b"v", 3, 2, True)
    assert p.delete_key("k") and not p.check(["k"]) and s.num_keys() == 1
    assert p.compare_set("k", "", "w") == b"w" and s.get("pg/k") == b"w"


def test_many_keys_go_in_chunks_of_etcds_txn_limit(client):
    from etcdrun.rendezvous.torch.store import MAX_TXN_OPS

    s = _store(client)
    keys = [f"k{i}" for i in range(2 * MAX_TXN_OPS + 5)]
    s.multi_set(keys, [str(i) for i in range(len(keys))])
    assert s.multi_get(keys) == [str(i).encode() for i in range(len(keys))]
    assert s.check(keys) and s.num_keys() == len(keys)


def _grpc_requests(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total") and 'grpc_type="unary"' in line:
            method = line.split('grpc_method="', 1)[1].split('"', 1)[0]
            out[method] = out.get(method, 0.0) + float(line.rpartition(" ")[2])
    return out


def test_a_wait_reads_once_then_watches(etcd, client):
    """A whole second of waiting costs one read (the key and its queue, one Txn): the rest is
    the watch (never a poll).
    """
    import torch.distributed as dist

    url = f"http://{etcd.endpoint_list[0]}/metrics"
    s = _store(client)
    s.set("warm", b"")  # the client's channel and the watch stream are not what we count
    before = _grpc_requests(url)
    with pytest.raises(dist.DistStoreError, match="missing"):
        s.wait(["missing"], 1000 * MS)
    after = _grpc_requests(url)
    spent = {m: after[m] - before.get(m, 0.0) for m in after if after[m] != before.get(m, 0.0)}
    assert spent == {"Txn": 1.0}


def test_a_waiter_wakes_when_another_node_sets_the_key(etcd, client):
    s = _store(client, timeout=datetime.timedelta(seconds=30))
    other = EtcdClient(etcd.endpoints)
    try:
        from etcdrun.rendezvous.torch.store import EtcdStore

        theirs = EtcdStore(other, s.prefix)
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(s.get("late")))
        waiter.start()
        theirs.set("late", b"here")
        waiter.join(30)
        assert got == [b"here"]
    finally:
        other.close()


def test_a_key_set_and_gone_at_once_still_counts_for_a_peer_that_saw_before(etcd, client):
    """torch's exit barrier: the last node sets the key and leaves at once (its lease goes, and
    the key with it). A peer whose add came before still sees the key was set.
    """
    import torch.distributed as dist

    from etcdrun.rendezvous.torch.store import EtcdStore

    peer = _store(client, timeout=datetime.timedelta(seconds=5))
    peer.add("barrier/num_members", 1)  # the peer has checked in
    other = EtcdClient(etcd.endpoints)
    try:
        lease = other.lease(5)
        last = EtcdStore(other, peer.prefix, lease=lease.id)
        assert last.add("barrier/num_members", 1) == 2
        last.set("barrier/last_member", b"<val_ignored>")
        lease.revoke()  # the last node leaves: its keys vanish
        assert other.get(last.prefix + "barrier/last_member") is None  # gone from etcd
        peer.wait(["barrier/last_member"])  # set after what the peer saw: it counts
        newcomer = EtcdStore(client, peer.prefix)  # saw nothing: the key is simply missing
        with pytest.raises(dist.DistStoreError):
            newcomer.wait(["barrier/last_member"], 200 * MS)
    finally:
        other.close()


def test_keys_live_under_the_writers_lease(etcd, client):
    lease = client.lease(10)
    s = _store(client, lease=lease.id)
    s.set("a", b"1")
    s.add("n", 1)
    s.multi_set(["x", "y"], ["1", "2"])
    s.compare_set("c", "", "v")
    s.append("p", "q")
    assert client.get_prefix(s.prefix, count_only=True).count == 6
    assert all(kv.lease == lease.id for kv in client.get_prefix(s.prefix).kvs)
    lease.revoke()
    assert client.get_prefix(s.prefix, count_only=True).count == 0


def test_an_etcd_failure_is_torchs_network_error(etcd, torch_available):
    import torch.distributed as dist

    c = EtcdClient(etcd.endpoints)
    s = _store(c)
    s.set("a", b"1")
    c.close()
    with pytest.raises(dist.DistNetworkError, match="etcd store"):
        s.get("a")


def test_gloo_and_torchs_elastic_store_patterns_on_three_processes(etcd, torch_available):
    prefix = f"/t/{uuid.uuid4().hex[:8]}/store/"
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / "store_gloo.py"), etcd.endpoints, prefix, str(r), "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    res = sorted(
        (json.loads(out.strip().splitlines()[-1]) for out, _ in outs), key=lambda r: r["rank"]
    )
    assert [r["all_reduce"] for r in res] == [6.0] * 3  # 1 + 2 + 3 through gloo
    assert [r["group_all_reduce"] for r in res] == [3.0] * 3
    assert all(r["synchronize"] == ["hello 0", "hello 1", "hello 2"] for r in res)
    assert sorted(r["counter"] for r in res) == [1, 2, 3]  # atomic adds
    assert {r["counter_after"] for r in res} == {3}
    owners = {r["owner"] for r in res}  # compare_set: one winner, everyone sees the same
    assert len(owners) == 1 and {r["owner_after"] for r in res} == owners
    c = EtcdClient(etcd.endpoints)
    try:  # each process's lease went with it: nothing left
        assert c.get_prefix(prefix, count_only=True).count == 0
    finally:
        c.close()


# ---- docs/torch-store.md's table of torch's Store methods ---------------------------------------
_TABLE_ROW = re.compile(r"^\| `(\w+)` \| (yes|no) \| (yes|no) \|", re.M)
_S = datetime.timedelta(seconds=5)
_PROBES: dict[str, Callable[[Any], Any]] = {
    "set": lambda s: s.set("k", "v"),
    "get": lambda s: s.get("k"),
    "add": lambda s: s.add("n", 1),
    "compare_set": lambda s: s.compare_set("k", "v", "w"),
    "delete_key": lambda s: s.delete_key("n"),
    "num_keys": lambda s: s.num_keys(),
    "check": lambda s: s.check(["k"]),
    "wait": lambda s: (s.wait(["k"]), s.wait(["k"], _S)),
    "set_timeout": lambda s: s.set_timeout(_S),
    "timeout": lambda s: s.timeout,
    "multi_get": lambda s: s.multi_get(["k"]),
    "multi_set": lambda s: s.multi_set(["a"], ["b"]),
    "append": lambda s: s.append("a", "c"),
    "has_extended_api": lambda s: s.has_extended_api() or "False",
    "clone": lambda s: s.clone().get("k"),
    "barrier": lambda s: s.barrier("b", 1),
    "queue_push": lambda s: s.queue_push("q", "1"),
    "queue_pop": lambda s: s.queue_pop("q", block=False),
    "queue_len": lambda s: s.queue_len("q"),
    "list_keys": lambda s: s.list_keys(),
}


def _supported(store: Any, method: str) -> str:
    """ "yes" when the call works, "no" when torch says it is not implemented."""
    try:
        answer = _PROBES[method](store)
    except NotImplementedError:
        return "no"
    return "no" if answer == "False" else "yes"


def test_the_store_method_table_in_the_docs_is_true(client):
    """Every method of torch's Store has a row, and each row says what the calls do."""
    import torch.distributed as dist

    rows = {
        m: (ours, prefixed)
        for m, ours, prefixed in _TABLE_ROW.findall((ROOT / "docs" / "torch-store.md").read_text())
    }
    public = {m for m in dir(dist.Store) if not m.startswith("_")}
    assert set(rows) == public == set(_PROBES)
    s = _store(client, timeout=_S)
    p = dist.PrefixStore("p", _store(client, timeout=_S))
    s.queue_push("q", "0")  # queue_pop without blocking has an item on the EtcdStore
    seen = {m: (_supported(s, m), _supported(p, m)) for m in _PROBES}
    assert seen == rows
