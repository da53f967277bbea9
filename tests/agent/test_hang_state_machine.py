"""HangWatchdog's state machine (agent/hang/watchdog.py) in one process: the one-process
HangPort, a worker group of the watchdog's own reading (``info``, ``workers``, ``log_paths``)
over real sleeping processes, and progress pages written by the test. The end-to-end tests
(test_hang_watchdog.py, tests/pytorch) run it with real agents; these pin each transition:
WATCHING → alarm, alarm → every node's report, reports → one verdict, verdict → the blamed
node kills its rank and writes its error file, and what is never judged.

The sleeping workers have no stack hook, so each is "silent" in a report: the verdict then
names the alarm's rank (verdict.py). Waits are on the notices posted; what must not happen is
watched for three timeouts.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import wait_for

from etcdrun.agent.hang import stacks
from etcdrun.agent.hang.watchdog import REPORT_WAIT, HangWatchdog
from etcdrun.agent.worker import beat
from etcdrun.rendezvous.api import HangNotice, HangPort

TIMEOUT = 0.5  # the watchdog's --hang-timeout here: short, so the tests are quick


@dataclass(frozen=True)
class Info:
    round: int
    node_count: int
    run_id: str = "hang-unit"


@dataclass(frozen=True)
class Worker:
    global_rank: int
    pid: int


@dataclass(frozen=True)
class Files:
    progress: str
    stacks: str
    error_file: str


@dataclass
class Group:
    """What HangWatchdog reads of the agent's WorkerGroup."""

    info: Info | None
    workers: list[Worker] = field(default_factory=list)
    log_paths: dict[int, Files] = field(default_factory=dict)


class Recorder(HangPort):
    """The one-process port, keeping every notice delivered."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[HangNotice] = []
        self.subscribe(self.seen.append)

    def kinds(self, kind: str) -> list[HangNotice]:
        return [n for n in list(self.seen) if n.kind == kind]


class Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: str, **details: Any) -> None:
        self.emitted.append((event, details))

    def names(self) -> list[str]:
        return [e for e, _ in list(self.emitted)]


def write_beat(path: str, step: int, at_ns: int) -> None:
    with open(path, "r+b") as fp:
        fp.write(beat.LAYOUT.pack(1, step, at_ns))


@pytest.fixture
def sleepers():
    """Real processes that never answer a stack dump (no hook): started per call, killed after."""
    procs: list[subprocess.Popen] = []

    def start(n: int) -> list[int]:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return [p.pid for p in procs[-n:]]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def node(tmp_path: Path, name: str, ranks: list[int], pids: list[int], nodes: int) -> Group:
    workers, paths = [], {}
    for rank, pid in zip(ranks, pids, strict=True):
        d = tmp_path / name / str(rank)
        d.mkdir(parents=True)
        files = Files(str(d / "progress"), str(d / "stacks.log"), str(d / "error.json"))
        beat.create(files.progress)
        workers.append(Worker(rank, pid))
        paths[rank] = files
    return Group(Info(1, nodes), workers, paths)


def assert_never_judged(group: Group) -> None:
    """Three timeouts with no notice from a watchdog over ``group``: had it judged a rank, it
    would have posted its alarm within one.
    """
    port = Recorder()
    dog = watchdog(group, port, "a")
    try:
        deadline = time.monotonic() + 3 * TIMEOUT
        while time.monotonic() < deadline:
            assert not port.seen
            time.sleep(0.05)
    finally:
        dog.close()


def watchdog(group: Group, port: HangPort, name: str, events: Events | None = None):
    dog = HangWatchdog(group, port, TIMEOUT, lambda: name, events)
    dog.start()
    return dog


def test_a_stalled_rank_raises_one_alarm_and_its_node_kills_it_with_the_verdict(tmp_path, sleepers):
    pids = sleepers(2)
    group = node(tmp_path, "n0", [0, 1], pids, nodes=1)
    old = time.monotonic_ns()
    write_beat(group.log_paths[0].progress, 7, old)  # rank 0 beat once, at the round's start
    port, events = Recorder(), Events()
    # Rank 1 keeps beating: only rank 0 stalls.
    stop = threading.Event()

    def keep_beating() -> None:
        while not stop.is_set():
            write_beat(group.log_paths[1].progress, 9, time.monotonic_ns())
            stop.wait(0.02)

    beater = threading.Thread(target=keep_beating, daemon=True)
    beater.start()
    dog = watchdog(group, port, "n0", events)
    try:
        wait_for(lambda: port.kinds("verdict"), 10, "a verdict")
        wait_for(lambda: not stacks.alive(pids[0]), 5, "the stalled rank killed")
    finally:
        stop.set()
        dog.close()
    (alarm,) = port.kinds("alarm")
    assert (alarm.body["rank"], alarm.body["step"]) == (0, 7)
    assert alarm.body["stalled_s"] > TIMEOUT
    (report,) = port.kinds("report")  # one node: one report, with both ranks silent
    assert set(report.body["silent"]) == {"0", "1"}
    (verdict,) = port.kinds("verdict")
    assert (verdict.body["blamed"], verdict.body["rank"]) == ("n0", 0)
    assert stacks.alive(pids[1]), "a rank that kept beating is never killed"
    assert Path(group.log_paths[0].error_file).exists()  # the root cause every node reports
    assert not Path(group.log_paths[1].error_file).exists()
    assert events.names() == ["hang_alarm", "hang_verdict", "worker_killed_for_hang"]


def test_the_alarms_node_waits_for_every_nodes_report_and_only_the_blamed_node_kills(
    tmp_path, sleepers
):
    """Two nodes on one port: both report, the alarm's node judges, the verdict reaches both,
    and only the node holding the blamed rank kills it.
    """
    a_pid, b_pid = sleepers(2)
    a = node(tmp_path, "a", [0], [a_pid], nodes=2)
    b = node(tmp_path, "b", [1], [b_pid], nodes=2)
    write_beat(b.log_paths[1].progress, 3, time.monotonic_ns() + int(60e9))  # fresh all along
    write_beat(a.log_paths[0].progress, 3, time.monotonic_ns())  # stalls from now
    port = Recorder()
    dogs = [watchdog(a, port, "a"), watchdog(b, port, "b")]
    try:
        wait_for(lambda: port.kinds("verdict"), 10, "a verdict")
        wait_for(lambda: not stacks.alive(a_pid), 5, "rank 0 killed on node a")
    finally:
        for d in dogs:
            d.close()
    assert [n.node for n in port.kinds("alarm")] == ["a"]
    assert sorted(n.node for n in port.kinds("report")) == ["a", "b"]
    (verdict,) = port.kinds("verdict")
    assert (verdict.node, verdict.body["blamed"], verdict.body["rank"]) == ("a", "a", 0)
    assert stacks.alive(b_pid)


def test_a_node_whose_report_never_comes_does_not_hold_the_verdict(tmp_path, sleepers):
    """The round has two nodes but only one watchdog answers (the other frozen, or cut off from
    etcd): the alarm's node judges with what it has once REPORT_WAIT has passed after its own
    report, not never. (What the verdict says then is verdict.py's, tested there.)
    """
    (pid,) = sleepers(1)
    group = node(tmp_path, "a", [0], [pid], nodes=2)
    write_beat(group.log_paths[0].progress, 1, time.monotonic_ns())
    port = Recorder()
    stamps: dict[str, float] = {}
    port.subscribe(lambda n: stamps.setdefault(n.kind, time.monotonic()))
    dog = watchdog(group, port, "a")
    try:
        wait_for(lambda: port.kinds("verdict"), 10, "a verdict")
    finally:
        dog.close()
    assert [n.node for n in port.kinds("report")] == ["a"]
    assert stamps["verdict"] - stamps["report"] >= REPORT_WAIT * 0.9


@pytest.mark.parametrize(
    "page",
    [
        "no beat",  # a worker that never called progress() or commit(): not watched
        "finished",  # its interpreter exited: its page says FINISHED
    ],
)
def test_a_rank_that_cannot_tell_its_progress_is_never_judged(tmp_path, sleepers, page):
    (pid,) = sleepers(1)
    group = node(tmp_path, "a", [0], [pid], nodes=1)
    if page == "finished":
        write_beat(group.log_paths[0].progress, beat.FINISHED, time.monotonic_ns())
    assert_never_judged(group)
    assert stacks.alive(pid)


def test_a_new_round_counts_as_progress(tmp_path, sleepers):
    """A rank handed a new round in place may wait for its peers longer than its last beat is
    old: its clock starts again with the round.
    """
    (pid,) = sleepers(1)
    group = node(tmp_path, "a", [0], [pid], nodes=1)
    write_beat(group.log_paths[0].progress, 1, time.monotonic_ns() - int(3600e9))  # an hour ago
    port = Recorder()
    dog = watchdog(group, port, "a")
    try:
        t0 = time.monotonic()
        wait_for(lambda: port.kinds("alarm"), 10, "an alarm")
        waited = time.monotonic() - t0
    finally:
        dog.close()
    (alarm,) = port.kinds("alarm")
    assert waited >= TIMEOUT * 0.9  # not at once, though the beat is an hour old
    assert alarm.body["stalled_s"] < 60  # counted from the round's start


def test_a_worker_that_ended_is_the_agents_not_the_watchdogs(tmp_path, sleepers):
    (pid,) = sleepers(1)
    group = node(tmp_path, "a", [0], [pid], nodes=1)
    write_beat(group.log_paths[0].progress, 1, time.monotonic_ns() - int(60e9))
    subprocess.run(["kill", "-9", str(pid)], check=True)
    wait_for(lambda: not stacks.alive(pid), 5, "the worker gone")
    assert_never_judged(group)
