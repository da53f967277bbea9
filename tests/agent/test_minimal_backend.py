"""The agent on a backend written against rendezvous/api.py alone: the ports are the whole way in.

Why: the agent used to probe the etcd handler for attributes the interface does not declare
(``view``, ``settings``, ``events``, ``client``, ``session``, ``node_id``); a new backend lost
the last-call line, the lease metrics, its events and its node id without a word. Here a backend
of a few dozen lines, in memory, answers only what ``RendezvousHandler``, ``LivenessPort`` and
``ReportPort`` declare, and the agent's events.jsonl, story lines, metrics, health and agent.log
must carry each of its answers. A second test holds ``WorkerSpec.max_restarts`` to its promise.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
import time
from pathlib import Path

import pytest
from agent_helpers import SCRIPTS, wait_for

from etcdrun.agent.api import WorkerSpec, WorkerState
from etcdrun.agent.config import LaunchConfig
from etcdrun.agent.elastic_agent import ElasticAgent
from etcdrun.agent.launcher import _name_nodes, _setup_logs
from etcdrun.agent.report.event_sink import read
from etcdrun.agent.report.metrics import MetricsConfig
from etcdrun.rendezvous.api import (
    Departure,
    LastCall,
    LeaseReading,
    Liveness,
    LivenessPort,
    Participant,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    ReportPort,
    RoundCause,
)
from etcdrun.rendezvous.events import EventLog
from etcdrun.rendezvous.static.handler import StaticRendezvousHandler

sys.path.insert(0, str(SCRIPTS))  # e2e_callables: importable here and in the workers

import e2e_callables  # noqa: E402

RUN = "minimal"
NODE = "mem-7"


class Lease(LivenessPort):
    """A lease that always answers, with figures a test can recognise."""

    def read(self) -> LeaseReading:
        return LeaseReading(Liveness.LIVE, time.monotonic() + 60, 1.0, 42.0, 0.25)


class Tells(ReportPort):
    """Every answer the report port declares, each one recognisable downstream."""

    def __init__(self, events: EventLog) -> None:
        self._events = events
        self.hook = None
        self.round = 0

    def node_id(self) -> str | None:
        return NODE

    def events(self) -> EventLog:
        return self._events

    def status(self) -> str:
        return "waiting in memory"

    def round_reason(self) -> str:
        return "node(s) lost: mem-9 (lease expired)" if self.round > 1 else ""

    def last_call(self) -> LastCall | None:
        return LastCall(time.time() + 100, 1, 1, 2)

    def observe(self, hook) -> None:
        self.hook = hook


class MemoryBackend(RendezvousHandler):
    """Round 1 with this node and mem-9; a pushed change gives round 2 without mem-9."""

    def __init__(self) -> None:
        self._events = EventLog(RUN)
        self._report = Tells(self._events)
        self._lease = Lease()
        self._changed = threading.Event()
        self._listeners: list = []
        self._closed = False

    def get_backend(self) -> str:
        return "memory"

    def get_run_id(self) -> str:
        return RUN

    def next_rendezvous(self) -> RendezvousInfo:
        self._changed.clear()
        self._report.round += 1
        n = self._report.round
        if self._report.hook is not None:
            self._report.hook("Txn", 0.002, None)  # a call to the backend's store
        me = Participant(NODE, 0, 2, "127.0.0.1", 0, host="here", pid=1)
        gone = Participant("mem-9", 1, 2, "127.0.0.2", 2, host="there", pid=9)
        members = (me, gone) if n == 1 else (me,)
        why = "node(s) lost: mem-9 (lease expired)"
        cause = None if n == 1 else RoundCause(why, (Departure("mem-9", "lease expired"),))
        self._events.node = NODE
        self._events.emit("round_accepted", round=n, node_rank=0, node_count=len(members))
        return RendezvousInfo(
            RUN,
            n,
            NODE,
            0,
            len(members),
            0,
            2 * len(members),
            "127.0.0.1",
            1,
            0,
            members,
            cause=cause,
        )

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def shutdown(self) -> bool:
        return True

    @property
    def membership_changed(self) -> threading.Event:
        return self._changed

    def on_membership_change(self, callback):
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback)

    def push(self) -> None:
        self._changed.set()
        for callback in list(self._listeners):
            callback()

    def liveness(self) -> LivenessPort:
        return self._lease

    def report(self) -> ReportPort:
        return self._report


def static_params(run_id: str, max_restarts: int) -> RendezvousParameters:
    config = {"rank": 0, "max_restarts": max_restarts}
    return RendezvousParameters("static", "", run_id, local_world_size=2, config=config)


def spec(handler: RendezvousHandler, tmp_path: Path, **kw) -> WorkerSpec:
    return WorkerSpec(
        local_world_size=2,
        rdzv_handler=handler,
        entrypoint=e2e_callables.run_until_go,
        args=(str(tmp_path),),
        monitor_interval=3600,
        start_method="fork",
        log_dir=str(tmp_path / "logs"),
        stop_grace=5,
        prewarm="none",
        **kw,
    )


def test_the_agent_reports_everything_a_minimal_backend_tells(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="etcdrun")
    h = MemoryBackend()
    log_handler = _setup_logs(LaunchConfig(nproc_per_node=2, log_dir=str(tmp_path / "logs")))
    _name_nodes(log_handler, h)
    agent = ElasticAgent(
        spec(h, tmp_path),
        status_interval=0.05,
        console_out=io.BytesIO(),
        console_err=io.BytesIO(),
        metrics=MetricsConfig(handler="console"),
    )
    live: list[dict] = []
    results = []
    runner = threading.Thread(target=lambda: results.append(agent.run()), name="test-agent")
    runner.start()
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready_*"))) == 2, 30, "the first workers")
        live.append(agent.observer.metrics.live())
        health = agent.observer.health()
        (tmp_path / "go").touch()
        h.push()
    finally:
        runner.join(60)
        logging.getLogger("etcdrun").removeHandler(log_handler)
        log_handler.close()
    assert results and results[0].state == WorkerState.SUCCEEDED, results

    events = read(str(tmp_path / "logs" / "events.jsonl"))
    ours = [e for e in events if e["event"] == "round_accepted"]
    assert [e["round"] for e in ours] == [1, 2] and {e["node"] for e in ours} == {NODE}
    assert [e["event"] for e in events].count("worker_started") == 4
    restarted = next(e for e in events if e["event"] == "workers_restarted")
    assert restarted["why"] == "node_lost"

    # The story line, from the backend's RoundCause; the waiting line is its status or last call.
    assert "node 1 (there, pid 9) lost: lease expired; new round 2 with 1 node" in caplog.text
    # Metrics: the lease from the liveness port, the last call and the store calls from report.
    gauges = live[0]["gauges"]
    assert gauges["lease_time_to_expiry_seconds"] == 42.0
    assert gauges["lease_keepalive_lag_seconds"] == 0.25
    assert 99 < gauges["last_call_seconds_left"] <= 100
    assert "Txn" in agent.observer.metrics.snapshot()["etcd"]
    assert agent.observer.metrics.gauges["round"] == 2.0  # from the backend's own events
    assert health["lease_time_left_s"] == 42.0 and health["node"] == NODE
    # agent.log names the node as the report port gives it.
    log_lines = (tmp_path / "logs" / "agent.log").read_text().splitlines()
    assert any(f" {NODE} etcdrun" in line for line in log_lines), log_lines[:3]
    assert h._report.hook is None  # the agent stopped observing when it closed


def test_a_worker_spec_budget_other_than_the_rendezvous_is_refused(tmp_path):
    """torch's WorkerSpec default (3) used to be silently ignored: the rendezvous owns the
    budget. A value given must be the rendezvous' own; None takes it.
    """
    static = StaticRendezvousHandler(static_params("budget", max_restarts=1))
    agent = ElasticAgent(spec(static, tmp_path, max_restarts=3), console_out=io.BytesIO())
    with pytest.raises(ValueError, match=r"WorkerSpec.max_restarts=3, but the rendezvous' "):
        agent.run()

    (tmp_path / "go").touch()
    static = StaticRendezvousHandler(static_params("budget-kept", max_restarts=1))
    agent = ElasticAgent(spec(static, tmp_path, max_restarts=1), console_out=io.BytesIO())
    result = agent.run()
    assert result.state == WorkerState.SUCCEEDED
    assert json.dumps(sorted(result.return_values)) == "[0, 1]"
