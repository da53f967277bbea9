"""launch_agent's rendezvous set-up (the reference's rules) and its small helpers.

Running a whole job needs the elastic agent; those tests live with it. Here a capturing backend
records the RendezvousParameters the launcher builds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
from typing import Any

import pytest
from agent_helpers import SCRIPTS

from etcdrun.agent.api import WorkerSpec, entrypoint_name
from etcdrun.agent.config import LaunchConfig
from etcdrun.agent.launcher import _make_rdzv_handler, _setup_logs, elastic_launch
from etcdrun.rendezvous import registry
from etcdrun.rendezvous.free_port import reserve_free_port
from etcdrun.rendezvous.static.handler import StaticRendezvousHandler


@pytest.fixture
def captured():
    """Registers 'capture' (a static handler that records its parameters) for one test."""
    before = dict(registry._backends)
    seen = []

    def factory(params):
        seen.append(params)
        # The static backend has no leader to evict anyone: the key is recorded, not served.
        conf = {k: v for k, v in params.config.items() if k != "evict_stragglers"}
        return StaticRendezvousHandler(dataclasses.replace(params, config=conf))

    registry.register_backend("capture", factory)
    yield seen
    registry._backends.clear()
    registry._backends.update(before)


def test_static_without_endpoint_reserves_a_free_port():
    h = _make_rdzv_handler(LaunchConfig())
    info = h.next_rendezvous()
    assert info.master_addr == "127.0.0.1" and 0 < info.master_port < 65536


def test_static_uses_master_addr_and_port():
    h = _make_rdzv_handler(LaunchConfig(master_addr="10.0.0.7", master_port=23456))
    info = h.next_rendezvous()
    assert (info.master_addr, info.master_port) == ("10.0.0.7", 23456)


def test_static_master_addr_with_free_port_and_ipv6():
    info = _make_rdzv_handler(LaunchConfig(master_addr="::1")).next_rendezvous()
    assert info.master_addr == "::1" and info.master_port > 0


def test_static_node_rank_and_sizes():
    """Both nodes of the static job: they meet on the master's port before any worker runs."""
    port = reserve_free_port()
    hs = [
        _make_rdzv_handler(
            LaunchConfig(min_nodes=2, max_nodes=2, nproc_per_node=3, node_rank=r, master_port=port)
        )
        for r in (0, 1)
    ]
    infos: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda r=r: infos.__setitem__(r, hs[r].next_rendezvous()))
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for h in hs:
        h.shutdown()
    info = infos[1]
    assert (info.node_rank, info.first_global_rank, info.world_size) == (1, 3, 6)


def test_parameters_passed_to_the_backend(captured):
    c = LaunchConfig(
        min_nodes=2,
        max_nodes=5,
        nproc_per_node=4,
        run_id="r1",
        rdzv_backend="capture",
        rdzv_endpoint="h:1",
        rdzv_timeout=30,
        rdzv_configs={"rank": 0},
        local_addr="10.9.9.9",
        node_rank=0,
    )
    _make_rdzv_handler(c)
    (p,) = captured
    assert (p.backend, p.endpoint, p.run_id) == ("capture", "h:1", "r1")
    assert (p.min_nodes, p.max_nodes, p.local_world_size) == (2, 5, 4)
    assert p.local_addr == "10.9.9.9"
    # min/max are fields, not config keys; the rendezvous owns the restart budget
    assert p.config == {"rank": 0, "join_timeout": 30, "max_restarts": 0}
    assert c.rdzv_configs == {"rank": 0}  # the caller's dict is not modified


def test_rdzv_timeout_does_not_override_join_timeout(captured):
    c = LaunchConfig(
        rdzv_backend="capture", rdzv_timeout=30, rdzv_configs={"join_timeout": 5, "rank": 0}
    )
    _make_rdzv_handler(c)
    assert captured[0].config["join_timeout"] == 5


def test_no_rdzv_timeout_no_join_timeout(captured):
    _make_rdzv_handler(LaunchConfig(rdzv_backend="capture", rdzv_configs={"rank": 0}))
    assert "join_timeout" not in captured[0].config


def test_a_one_node_etcd_job_without_a_run_id_runs_under_a_unique_one(etcd, tmp_path, caplog):
    """torch's launcher tests call elastic_launch(rdzv_backend="etcd") with no run id, as torch
    allows: one node meets nobody, so it runs under a unique id, said in the log.
    """
    sys.path.insert(0, str(SCRIPTS))  # e2e_callables, here and in the spawned workers
    import e2e_callables

    config = LaunchConfig(
        nproc_per_node=1,
        rdzv_backend="etcd",
        rdzv_endpoint=etcd.endpoints,
        rdzv_configs={"lease_ttl": 2},
        monitor_interval=0.05,
        log_dir=str(tmp_path),
    )
    with caplog.at_level(logging.WARNING, logger="etcdrun"):
        values = elastic_launch(config, e2e_callables.rank_times)(3)
    run_id = values[0]["run_id"]  # the workers' TORCHELASTIC_RUN_ID
    assert run_id not in ("", "none") and config.run_id == run_id
    assert f"this one-node job runs as {run_id}" in caplog.text
    again = LaunchConfig(rdzv_backend="etcd", rdzv_endpoint=etcd.endpoints)
    handler = _make_rdzv_handler(again)
    try:
        assert handler.get_run_id() == again.run_id not in (run_id, "none")
    finally:
        handler.shutdown()


def test_an_etcd_job_of_more_nodes_still_needs_a_run_id(etcd):
    """On random ids its nodes would never meet: refused, as before."""
    config = LaunchConfig(
        min_nodes=1, max_nodes=2, rdzv_backend="etcd", rdzv_endpoint=etcd.endpoints
    )
    with pytest.raises(ValueError, match="strangers"):
        _make_rdzv_handler(config)
    assert config.run_id == "none"


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown rendezvous backend 'nope'"):
        _make_rdzv_handler(LaunchConfig(rdzv_backend="nope"))


def test_entrypoint_name():
    def train():
        pass

    assert entrypoint_name(None, []) == "None"
    assert entrypoint_name("/usr/bin/env", ["x"]) == "env"
    assert entrypoint_name(sys.executable, ["-u", "/a/train.py", "--lr", "1"]) == "train.py"
    assert entrypoint_name(sys.executable, ["-u", "-m", "pkg.mod"]) == "pkg.mod"
    assert entrypoint_name(train, []) == "test_entrypoint_name.<locals>.train"
    # One rule: the launcher's log line and every failure report name the same thing.
    spec = WorkerSpec(entrypoint=sys.executable, args=("-u", "/a/train.py"))
    assert spec.get_entrypoint_name() == "train.py"


def test_setup_logs_writes_agent_log(tmp_path):
    c = LaunchConfig(log_dir=str(tmp_path / "logs"))
    handler = _setup_logs(c)
    try:
        logging.getLogger("etcdrun").error("hello from the agent")
    finally:
        logging.getLogger("etcdrun").removeHandler(handler)
        handler.close()
    text = (tmp_path / "logs" / "agent.log").read_text()
    assert "hello from the agent" in text
    # Every line names its node (several agents may share the file): <host>:<pid> until the
    # rendezvous has a node id.
    assert text.split(" ")[2] == f"{socket.gethostname()}:{os.getpid()}"
    assert _setup_logs(LaunchConfig()) is None


def test_max_restarts_given_twice_must_agree(captured):
    """One value feeds the decisions, TORCHELASTIC_MAX_RESTARTS and the logs."""
    agree = LaunchConfig(rdzv_backend="capture", max_restarts=3, rdzv_configs={"max_restarts": "3"})
    _make_rdzv_handler(agree)
    assert captured[-1].config["max_restarts"] == "3"
    only_conf = LaunchConfig(rdzv_backend="capture", rdzv_configs={"max_restarts": 5})
    _make_rdzv_handler(only_conf)
    assert captured[-1].config["max_restarts"] == 5
    clash = LaunchConfig(rdzv_backend="capture", max_restarts=3, rdzv_configs={"max_restarts": 5})
    with pytest.raises(ValueError, match=r"--max-restarts 3 and --rdzv-conf max_restarts=5"):
        _make_rdzv_handler(clash)


def test_evict_stragglers_given_twice_follows_the_same_rule(captured):
    """It silently lost to the key before: --evict-stragglers with evict_stragglers=0 ran
    without eviction. Now a flag that is on and a key that says off are one line.
    """
    on = LaunchConfig(rdzv_backend="capture", evict_stragglers=True)
    _make_rdzv_handler(on)
    assert captured[-1].config["evict_stragglers"] == "1"
    _make_rdzv_handler(LaunchConfig(rdzv_backend="capture"))
    assert "evict_stragglers" not in captured[-1].config  # off: the backend's default
    both = LaunchConfig(
        rdzv_backend="capture", evict_stragglers=True, rdzv_configs={"evict_stragglers": "true"}
    )
    _make_rdzv_handler(both)
    assert captured[-1].config["evict_stragglers"] == "true"
    only_conf = LaunchConfig(rdzv_backend="capture", rdzv_configs={"evict_stragglers": "yes"})
    _make_rdzv_handler(only_conf)
    assert captured[-1].config["evict_stragglers"] == "yes"
    clash = LaunchConfig(
        rdzv_backend="capture", evict_stragglers=True, rdzv_configs={"evict_stragglers": "0"}
    )
    with pytest.raises(ValueError, match=r"--evict-stragglers and --rdzv-conf evict_stragglers=0"):
        _make_rdzv_handler(clash)
