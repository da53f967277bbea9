"""The elastic agent's driver on real workers (static backend, no etcd): how it wakes, restarts.

Why ``monitor_interval=3600`` here: the agent must wake on a worker's exit and on a membership
change by itself, never by polling; an agent that still polled would sit out the hour and the
test would hit its timeout. Why count ``poll()`` with ``monitor_interval=0``: the old loop waited
``monitor_interval`` between polls, so 0 made it spin; the count shows it sleeps instead.
"""

from __future__ import annotations

import io
import logging
import sys
import threading
from pathlib import Path

import pytest
from agent_helpers import SCRIPTS, wait_for

from etcdrun.agent.api import WorkerSpec, WorkerState
from etcdrun.agent.config import LaunchConfig
from etcdrun.agent.elastic_agent import ElasticAgent
from etcdrun.agent.errors import ChildFailedError
from etcdrun.agent.launcher import elastic_launch
from etcdrun.agent.report.event_sink import read
from etcdrun.rendezvous.api import LeaseReading, Liveness, LivenessPort, RendezvousParameters
from etcdrun.rendezvous.static.handler import StaticRendezvousHandler

sys.path.insert(0, str(SCRIPTS))  # e2e_callables: importable here and in the workers

import e2e_callables  # noqa: E402


class PushingStatic(StaticRendezvousHandler):
    """The static backend plus a membership change a test pushes, the way etcd's watch does."""

    def __init__(self, params: RendezvousParameters) -> None:
        super().__init__(params)
        self.listeners: list = []
        self.joins = 0

    def on_membership_change(self, callback):
        self.listeners.append(callback)
        return lambda: self.listeners.remove(callback)

    def push(self) -> None:
        self.membership_changed.set()
        for callback in list(self.listeners):
            callback()

    def next_rendezvous(self):
        self.membership_changed.clear()  # a new round: this node runs in it
        self.joins += 1
        return super().next_rendezvous()


def static_params(run_id: str, nproc: int = 2) -> RendezvousParameters:
    return RendezvousParameters("static", "", run_id, local_world_size=nproc, config={"rank": 0})


def agent_for(handler, tmp_path: Path, entrypoint, *args, monitor: float) -> ElasticAgent:
    spec = WorkerSpec(
        local_world_size=2,
        rdzv_handler=handler,
        entrypoint=entrypoint,
        args=args,
        monitor_interval=monitor,
        start_method="fork",
        log_dir=str(tmp_path / "logs"),
        stop_grace=5,
    )
    return ElasticAgent(spec, console_out=io.BytesIO(), console_err=io.BytesIO())


def test_monitor_interval_zero_sleeps_instead_of_spinning(tmp_path):
    h = StaticRendezvousHandler(static_params("no-spin"))
    agent = agent_for(h, tmp_path, e2e_callables.nap, 0.5, monitor=0)
    polls = []
    real_poll = agent.group.poll
    agent.group.poll = lambda: polls.append(1) or real_poll()
    result = agent.run()
    assert result.state == WorkerState.SUCCEEDED and result.return_values == {0: "0", 1: "1"}
    # One look when the workers start, one per wake-up (two exits, perhaps coalesced).
    assert len(polls) <= 4, f"{len(polls)} polls in half a second: the agent spins"


def test_a_pushed_membership_change_wakes_the_agent_which_rejoins(tmp_path):
    h = PushingStatic(static_params("pushed"))
    agent = agent_for(h, tmp_path, e2e_callables.run_until_go, str(tmp_path), monitor=3600)
    results = []
    runner = threading.Thread(target=lambda: results.append(agent.run()), name="test-agent")
    runner.start()
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready_*"))) == 2, 30, "the first workers")
        (tmp_path / "go").touch()
        h.push()  # the first attempt's workers sleep: only the push can end the attempt
    finally:
        runner.join(60)
    assert results and results[0].state == WorkerState.SUCCEEDED, results
    assert results[0].return_values == {0: "0", 1: "1"}
    assert (agent.rounds, h.joins) == (2, 2)
    assert len(list(tmp_path.glob("ready_*"))) == 4
    assert h.listeners == []  # run() unsubscribed


def test_static_restart_through_the_rendezvous_then_success(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="etcdrun")
    config = LaunchConfig(
        nproc_per_node=2,
        run_id="restart-once",
        max_restarts=1,
        monitor_interval=3600,  # worker exits wake the agent
        start_method="fork",
        log_dir=str(tmp_path),
    )
    values = elastic_launch(config, e2e_callables.fail_once_on_rank_1)()
    assert values == {0: 1, 1: 1}  # both ran again, with TORCHELASTIC_RESTART_COUNT=1
    attempts = sorted(p.name for p in (tmp_path / "restart-once").glob("attempt_*"))
    assert attempts == ["attempt_0", "attempt_1"]
    assert "worker rank 1 on " in caplog.text and "restarts used 0 of 1: 1 left" in caplog.text


def test_static_budget_spent_reports_our_root_cause(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="etcdrun")
    config = LaunchConfig(
        nproc_per_node=2,
        run_id="always-fails",
        max_restarts=1,
        monitor_interval=3600,
        start_method="fork",
        log_dir=str(tmp_path),
    )
    with pytest.raises(ChildFailedError) as err:
        elastic_launch(config, e2e_callables.always_fail_on_rank_1)()
    rank, root = err.value.get_first_failure()
    assert rank == 1 and "ValueError: rank 1 always fails" in root.message
    assert "attempt_1" in (root.error_file or "")  # our own error file, from the last attempt
    assert "the restart budget is spent: the job failed" in caplog.text


class Switch(LivenessPort):
    """A liveness port a test turns to LOST."""

    lost = False

    def read(self) -> LeaseReading:
        return LeaseReading(Liveness.LOST if self.lost else Liveness.LIVE)


class LosingStatic(PushingStatic):
    """A pushed change that says "your lease is lost" (etcd's fencing, S4), once."""

    def __init__(self, params: RendezvousParameters) -> None:
        super().__init__(params)
        self.port = Switch()

    def liveness(self) -> LivenessPort:
        return self.port

    def next_rendezvous(self):
        self.port.lost = False
        return super().next_rendezvous()


def test_a_lost_lease_fences_the_workers_and_every_step_is_one_event(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="etcdrun")
    h = LosingStatic(static_params("fenced"))
    agent = agent_for(h, tmp_path, e2e_callables.run_until_go, str(tmp_path), monitor=3600)
    results = []
    runner = threading.Thread(target=lambda: results.append(agent.run()), name="test-agent")
    runner.start()
    try:
        wait_for(lambda: len(list(tmp_path.glob("ready_*"))) == 2, 30, "the first workers")
        (tmp_path / "go").touch()
        h.port.lost = True
        h.push()
    finally:
        runner.join(60)
    assert results and results[0].state == WorkerState.SUCCEEDED, results
    events = read(str(tmp_path / "logs" / "events.jsonl"))
    names = [e["event"] for e in events]
    assert names == [
        *["worker_started"] * 2,
        *["worker_stopped"] * 2,  # at once (grace 0), by the agent
        "fenced",
        "workers_restarted",
        *["worker_started"] * 2,
        *["worker_exited"] * 2,  # the second attempt's workers end by themselves
    ], names
    stopped = [e for e in events if e["event"] == "worker_stopped"]
    assert {e["signal"] for e in stopped} == {"SIGKILL"}  # no grace: fencing kills at once
    assert {e["why"] for e in stopped} == {"lease lost"}
    assert events[names.index("workers_restarted")]["why"] == "lease_lost"
    assert {e["exit_code"] for e in events if e["event"] == "worker_exited"} == {0}
    assert "fenced: this node's lease was lost; its 2 worker(s) were stopped at once" in caplog.text
    assert "this node lost its lease and rejoined as node0" in caplog.text
