"""The backend registry and the static backend (no etcd involved)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest

from etcdrun.rendezvous import registry
from etcdrun.rendezvous.api import FailureInfo, RendezvousHandler, RendezvousParameters
from etcdrun.rendezvous.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTooManyNodesError,
)
from etcdrun.rendezvous.free_port import reserve_free_port
from etcdrun.rendezvous.registry import create_handler, known_backends, register_backend
from etcdrun.rendezvous.static.handler import (
    StaticRendezvousHandler,
    format_endpoint,
    parse_static_endpoint,
)


def params(**kw) -> RendezvousParameters:
    base = dict(backend="static", endpoint="10.1.2.3:29500", run_id="job")
    base.update(kw)
    return RendezvousParameters(**base)


@pytest.fixture
def scratch_backends():
    """Names registered by a test are removed again, so tests do not leak into each other."""
    before = dict(registry._backends)
    yield
    registry._backends.clear()
    registry._backends.update(before)


def assert_port_free(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", port))


# --- registry -------------------------------------------------------------------------------
def test_known_backends():
    assert {"static", "etcd", "etcd-v3"} <= set(known_backends())
    assert known_backends() == sorted(known_backends())


def test_unknown_backend_names_it_and_the_known_ones():
    with pytest.raises(ValueError) as err:
        create_handler(params(backend="zookeeper"))
    msg = str(err.value)
    assert "'zookeeper'" in msg
    for name in ("static", "etcd", "etcd-v3"):
        assert name in msg


def test_etcd_v3_is_an_alias_of_etcd():
    assert registry._backends["etcd-v3"] == registry._backends["etcd"]


def test_etcd_entries_resolve_to_the_etcd_handler_class():
    from etcdrun.rendezvous.etcd.handler import EtcdRendezvousHandler

    assert registry._resolve("etcd", "r") is EtcdRendezvousHandler
    assert registry._resolve("etcd-v3", "r") is EtcdRendezvousHandler


def test_create_handler_static():
    h = create_handler(params())
    assert isinstance(h, StaticRendezvousHandler) and h.get_backend() == "static"


def test_static_does_not_import_the_etcd_backend():
    # A fresh interpreter: other tests (and the conftest) may have imported gRPC already.
    code = (
        "import sys, json\n"
        "from etcdrun.rendezvous.registry import create_handler\n"
        "from etcdrun.rendezvous.api import RendezvousParameters as P\n"
        "create_handler(P(backend='static', endpoint='127.0.0.1:1', run_id='x')).shutdown()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    mods = set(json.loads(out.stdout))
    assert "etcdrun.rendezvous.static.handler" in mods
    heavy = {
        m
        for m in mods
        if m.split(".")[0] in ("grpc", "tenacity")
        or m.startswith(("google.protobuf", "etcdrun.rendezvous.etcd", "etcdrun.proto"))
    }
    assert not heavy


def test_register_custom_backend(scratch_backends):
    seen = []

    def factory(p: RendezvousParameters) -> RendezvousHandler:
        seen.append(p)
        return StaticRendezvousHandler(p)

    register_backend("mine", factory)
    register_backend("mine", factory)  # same factory again: fine
    assert "mine" in known_backends()
    p = params(backend="mine")
    assert isinstance(create_handler(p), StaticRendezvousHandler)
    assert seen == [p]
    with pytest.raises(ValueError, match="'mine' is already registered"):
        register_backend("mine", lambda p: StaticRendezvousHandler(p))


def test_register_rejects_bad_input(scratch_backends):
    with pytest.raises(ValueError):
        register_backend("", lambda p: None)
    with pytest.raises(ValueError, match="module:function"):
        register_backend("lazy", "no_colon_here")
    with pytest.raises(TypeError):
        register_backend("thing", 42)


def test_lazy_backend_that_cannot_load_is_a_rendezvous_error(scratch_backends):
    register_backend("ghost", "etcdrun.no_such_module_here:create_rdzv_handler")
    with pytest.raises(RendezvousError) as err:
        create_handler(params(backend="ghost", run_id="r7"))
    assert "'ghost'" in str(err.value) and "run r7" in str(err.value)


def test_lazy_backend_resolves_module_function(scratch_backends):
    register_backend("static2", "etcdrun.rendezvous.static.handler:create_rdzv_handler")
    assert isinstance(create_handler(params(backend="static2")), StaticRendezvousHandler)


def test_factory_must_return_a_handler(scratch_backends):
    register_backend("bogus", lambda p: object())
    with pytest.raises(TypeError, match="not a RendezvousHandler"):
        create_handler(params(backend="bogus"))


# --- static handler -------------------------------------------------------------------------
def meet(handlers: list[RendezvousHandler], timeout: float = 30) -> list[Any]:
    """next_rendezvous() of every node of a job at once (they meet on the master's port)."""
    out: list[Any] = [None] * len(handlers)

    def one(i: int) -> None:
        try:
            out[i] = handlers[i].next_rendezvous()
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "the nodes did not meet"
    return out


@pytest.fixture
def local_job():
    """Handlers of one static job on 127.0.0.1 and a free port; shut down afterwards."""
    made: list[RendezvousHandler] = []
    port = reserve_free_port()

    def make(**kw) -> RendezvousHandler:
        h = create_handler(params(endpoint=f"127.0.0.1:{port}", **kw))
        made.append(h)
        return h

    yield make
    for h in made:
        h.shutdown()


def test_ranks_and_info_values(local_job):
    hs = [local_job(node_rank=r, max_nodes=3, local_world_size=4, run_id="j1") for r in range(3)]
    info = meet(hs)[1]
    h = hs[1]
    assert (info.run_id, info.round, info.restart_count) == ("j1", 0, 0)
    assert (info.node_rank, info.node_count) == (1, 3)
    assert (info.first_global_rank, info.world_size) == (4, 12)
    assert info.master_addr == "127.0.0.1"
    parts = info.participants
    assert [p.node_rank for p in parts] == [0, 1, 2]
    assert [p.first_global_rank for p in parts] == [0, 4, 8]
    assert all(p.local_world_size == 4 for p in parts)
    assert parts[0].addr == "127.0.0.1"  # rank 0 is the master
    assert info.node_id == parts[1].node_id
    assert h.get_run_id() == "j1" and h.num_nodes_waiting() == 0


def test_every_node_of_a_job_agrees(local_job):
    infos = meet([local_job(node_rank=r, max_nodes=4, local_world_size=2) for r in range(4)])
    ranks = [list(range(i.first_global_rank, i.first_global_rank + 2)) for i in infos]
    assert sum(ranks, []) == list(range(8))
    assert len({(i.world_size, i.master_addr, i.master_port, i.round) for i in infos}) == 1
    assert infos[0].world_size == 8


def test_config_rank_wins_over_node_rank(local_job):
    hs = [local_job(node_rank=0, max_nodes=3, config={"rank": str(r)}) for r in (2, 0, 1)]
    assert [i.node_rank for i in meet(hs)] == [2, 0, 1]


def test_bad_config_rank():
    with pytest.raises(ValueError, match="rank 'x' is not an integer"):
        create_handler(params(config={"rank": "x"}))


@pytest.mark.parametrize("rank", [3, 7, -1])
def test_node_rank_outside_the_job(rank):
    with pytest.raises(RendezvousTooManyNodesError) as err:
        create_handler(params(max_nodes=3, config={"rank": rank}, run_id="big"))
    msg = str(err.value)
    assert f"node rank {rank}" in msg and "3 node(s)" in msg and "run big" in msg


def test_unknown_config_key_is_named():
    with pytest.raises(ValueError, match="lease_ttl"):
        create_handler(params(config={"lease_ttl": "2"}))
    # join_timeout (from LaunchConfig.rdzv_timeout) is accepted and has nothing to do.
    create_handler(params(config={"join_timeout": 5, "rank": 0}))


@pytest.mark.parametrize("endpoint", ["", "127.0.0.1", "localhost:0", "[::1]"])
def test_free_port_reserved_when_none_given(endpoint):
    h = create_handler(params(endpoint=endpoint))
    info = h.next_rendezvous()
    assert 0 < info.master_port < 65536
    assert_port_free(info.master_port)
    assert h.next_rendezvous().master_port == info.master_port  # stable across restarts
    expected_host = {"": "127.0.0.1", "localhost:0": "localhost", "[::1]": "::1"}
    assert info.master_addr == expected_host.get(endpoint, endpoint)


@pytest.mark.parametrize(
    "endpoint, expected",
    [
        ("host:1234", ("host", 1234)),
        ("[::1]:29500", ("::1", 29500)),
        ("fe80::1", ("fe80::1", None)),
        ("  h:80 ", ("h", 80)),
        ("h:", ("h", None)),
    ],
)
def test_parse_static_endpoint(endpoint, expected):
    assert parse_static_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["h:x", "h:70000", "[::1", "[::1]x", ":80", "a b:1", "h/x:1"])
def test_malformed_static_endpoint(endpoint):
    with pytest.raises(ValueError, match="malformed static rendezvous endpoint"):
        create_handler(params(endpoint=endpoint))


def test_format_endpoint_roundtrip():
    for host in ("10.0.0.1", "::1", "node-3"):
        assert parse_static_endpoint(format_endpoint(host, 42)) == (host, 42)


FAILURE = FailureInfo(node_id="node0", host="h", global_rank=0, exit_code=1)


def test_restart_reruns_the_round_while_the_budget_lasts_then_closes_with_the_failure():
    """The same contract as etcd: the backend owns the budget, the agent has one path."""
    h = create_handler(params(config={"max_restarts": 2}))
    infos = [h.next_rendezvous()]
    for _ in range(2):
        assert h.request_restart("worker failed", FAILURE) is True
        infos.append(h.next_rendezvous())
    assert [i.restart_count for i in infos] == [0, 1, 2]
    assert {i.round for i in infos} == {0} and {i.max_restarts for i in infos} == {2}
    assert h.closed_failure() is None
    assert h.request_restart("worker failed again", FAILURE) is False  # spent
    assert h.is_closed() and h.closed_failure() == FAILURE
    with pytest.raises(RendezvousClosedError):
        h.next_rendezvous()


def test_static_max_restarts_must_be_a_count():
    with pytest.raises(ValueError, match="max_restarts 'x'"):
        create_handler(params(config={"max_restarts": "x"}))


def test_membership_changed_is_an_event_never_set():
    h = create_handler(params())
    ev = h.membership_changed
    assert isinstance(ev, threading.Event) and ev is h.membership_changed
    h.next_rendezvous()
    h.next_rendezvous()
    h.set_closed()
    h.shutdown()
    assert not ev.is_set()


def test_closed_and_shutdown():
    h = create_handler(params(run_id="c1"))
    assert not h.is_closed()
    h.next_rendezvous()
    h.set_closed()
    assert h.is_closed()
    with pytest.raises(RendezvousClosedError, match="run c1"):
        h.next_rendezvous()

    h2 = create_handler(params())
    assert h2.shutdown() is True
    assert h2.shutdown() is True  # idempotent
    with pytest.raises(RendezvousClosedError, match="shut down"):
        h2.next_rendezvous()
