"""The hang watchdog's parts, without a job (design.md §4b): who is blamed (a pure function,
every case), a real worker's stack read back from faulthandler, the beat page, the one-process
hang port, and the flag. tests/pytorch/test_hang.py runs it end to end on real jobs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from agent_helpers import wait_for

from etcdrun.agent import LaunchConfig
from etcdrun.agent.api import WorkerSpec
from etcdrun.agent.hang import stacks
from etcdrun.agent.hang.verdict import Alarm, blame
from etcdrun.agent.worker import beat
from etcdrun.agent.worker.spawn import SITE_DIR
from etcdrun.rendezvous.api import HangNotice, HangPort

ALARM = Alarm(round=4, node="b", rank=1, stalled_s=3.2, step=19)


def waits(where="distributed_c10d.py:2501 in all_reduce"):
    return {"where": where, "waiting": True}


def own(where):
    return {"where": where, "waiting": False}


# ---- blame: a pure function -------------------------------------------------------------------
def test_the_rank_outside_torch_distributed_is_blamed_whoever_raised_the_alarm():
    reports = {
        "a": {"ranks": {"0": waits(), "1": own("train.py:31 in step")}, "silent": {}},
        "b": {"ranks": {"2": waits(), "3": waits()}, "silent": {}},
    }
    v = blame(Alarm(4, "b", 2, 3.2), reports, nodes=2)
    assert (v.node, v.rank, v.where, v.act) == ("a", 1, "train.py:31 in step", True)
    assert v.line == (
        "rank 1 on node a made no progress for 3.2 s: stuck at train.py:31 in step; "
        "3 other rank(s) wait in torch.distributed"
    )


def test_among_several_ranks_stuck_on_their_own_the_alarms_is_blamed_else_the_lowest():
    reports = {"a": {"ranks": {"0": own("x.py:1 in f"), "1": own("y.py:2 in g")}}}
    assert blame(Alarm(4, "a", 1, 3.0), reports, nodes=1).rank == 1
    assert blame(Alarm(4, "a", 7, 3.0), reports, nodes=1).rank == 0


def test_a_rank_that_cannot_answer_is_blamed_when_every_answer_waits():
    reports = {
        "a": {"ranks": {"0": waits()}, "silent": {}},
        "b": {"ranks": {"2": waits()}, "silent": {"3": "pid 9 is stopped: no stack"}},
    }
    v = blame(ALARM, reports, nodes=2)
    assert (v.node, v.rank, v.act) == ("b", 3, True)
    assert v.line.endswith("made no progress for 3.2 s: pid 9 is stopped: no stack")


def test_a_node_that_did_not_report_is_said_and_nobody_is_killed():
    reports = {"b": {"ranks": {"1": waits(), "2": waits()}}}
    v = blame(ALARM, reports, nodes=2)
    assert v.act is False and "1 node(s) did not report" in v.line


def test_when_every_rank_waits_the_alarms_rank_is_blamed():
    reports = {"b": {"ranks": {"1": waits("distributed_c10d.py:9 in barrier"), "2": waits()}}}
    v = blame(ALARM, reports, nodes=1)
    assert (v.rank, v.act) == (1, True)
    assert "every rank waits in torch.distributed (rank 1 at distributed_c10d.py:9" in v.line


def test_alarm_and_verdict_survive_their_trip_through_json():
    import json

    body = json.loads(json.dumps(ALARM.body()))
    assert Alarm.of(4, "b", body) == ALARM
    v = blame(ALARM, {"b": {"ranks": {"1": own("t.py:3 in f")}}}, nodes=1)
    assert type(v).of(4, json.loads(json.dumps(v.body()))) == v


# ---- stacks: a real process, dumped by faulthandler from outside -------------------------------
STUCK = textwrap.dedent(
    """
    import os, sys, threading, time
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    r, w = os.pipe()
    print("ready", flush=True)
    os.read(r, 1)
    """
)


def test_a_worker_blocked_in_c_gives_its_main_threads_frame(tmp_path):
    path = tmp_path / "stacks.log"
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    env = {**os.environ, "PYTHONPATH": SITE_DIR, **stacks.env(str(path))}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"
        assert stacks.catches(proc.pid, stacks.SIGNAL)

        def in_read() -> stacks.Stack | None:  # "ready" comes a moment before os.read's line
            got = stacks.dump({5: (proc.pid, str(path))}, timeout=5)[5]
            assert isinstance(got, stacks.Stack), got
            return got if got.where() == "stuck.py:6 in <module>" else None

        got = wait_for(in_read, 10, "a dump in os.read's line, not the sleeping thread's")
        assert not got.waiting
        assert "in sleep" not in got.where() and "Thread 0x" in got.text  # every thread kept
        again = stacks.dump({5: (proc.pid, str(path))}, timeout=5)[5]  # a second dump parses too
        assert isinstance(again, stacks.Stack) and again.where() == got.where()
        proc.send_signal(19)  # SIGSTOP: it cannot answer, and the dump says so at once
        wait_for(lambda: stacks.stopped(proc.pid), 10, "the worker stopped")
        t0 = time.monotonic()
        said = stacks.dump({5: (proc.pid, str(path))}, timeout=5)[5]
        assert "is stopped" in said and time.monotonic() - t0 < 1
    finally:
        proc.kill()
        proc.wait()


def main_thread_dump(*frames: str, other_thread: bool = False) -> str:
    """A faulthandler dump as the hook writes it: the main thread's frames, innermost first."""
    text = "etcdrun stacks of pid 1, main thread 0x00000000000000aa\n"
    if other_thread:
        text += "Thread 0x00000000000000bb (most recent call first):\n"
        text += '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
    text += "Current thread 0x00000000000000aa (most recent call first):\n"
    return text + "".join(f"  File {f}\n" for f in frames)


def test_a_frame_in_torch_distributed_is_waiting_and_the_users_frame_is_shown():
    dump = main_thread_dump(
        '"/x/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce',
        '"/job/train.py", line 40 in step',
        '"/job/train.py", line 55 in <module>',
        other_thread=True,
    )
    got = stacks.parse(dump)
    assert got is not None and got.waiting
    assert got.where() == "train.py:40 in step (in distributed_c10d.py:2501 in all_reduce)"
    assert stacks.parse("no header here") is None


def test_a_rank_in_ddps_backward_waits_for_its_peers():
    """Found by the in-place hang test: DDP's peers of a rank asleep in its step wait inside
    ``loss.backward()`` (the all-reduce runs in autograd's C++ engine), and were blamed.
    """
    dump = main_thread_dump(
        '"/x/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward',
        '"/x/site-packages/torch/autograd/__init__.py", line 361 in backward',
        '"/x/site-packages/torch/_tensor.py", line 648 in backward',
        '"/job/train.py", line 51 in train',
    )
    got = stacks.parse(dump)
    assert got is not None and got.waiting
    assert got.where() == "train.py:51 in train (in graph.py:979 in _engine_run_backward)"


# ---- the beat page -----------------------------------------------------------------------------
def test_a_beat_is_read_back_and_a_page_without_one_reads_none(tmp_path, monkeypatch):
    path = str(tmp_path / "progress")
    beat.create(path)
    assert beat.read(path) is None
    monkeypatch.setenv(beat.VAR, path)
    writer = beat.Writer.from_env()
    before = time.monotonic_ns()
    writer.beat(7)
    writer.beat(None)
    got = beat.read(path)
    assert got.beats == 2 and got.step == -1 and got.at_ns >= before
    assert beat.read(str(tmp_path / "gone")) is None
    monkeypatch.delenv(beat.VAR)
    assert beat.Writer.from_env() is None


# ---- the default port and the flag -------------------------------------------------------------
def test_the_one_process_port_delivers_only_a_rounds_first_alarm():
    port, seen = HangPort(), []
    unsubscribe = port.subscribe(seen.append)
    port.post(HangNotice("alarm", 1, "a", {"rank": 0}))
    port.post(HangNotice("alarm", 1, "a", {"rank": 1}))
    port.post(HangNotice("report", 1, "a", {}))
    port.post(HangNotice("alarm", 2, "a", {"rank": 1}))
    unsubscribe()
    port.post(HangNotice("verdict", 2, "a", {}))
    assert [(n.kind, n.round, n.body.get("rank")) for n in seen] == [
        ("alarm", 1, 0),
        ("report", 1, None),
        ("alarm", 2, 1),
    ]


@pytest.mark.parametrize("bad", [0, 0.5, -3, float("nan")])
def test_a_hang_timeout_under_one_second_is_refused(bad):
    with pytest.raises(ValueError, match=r"hang_timeout .* must be at least 1 second"):
        LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, hang_timeout=bad)
    with pytest.raises(ValueError, match="hang_timeout"):
        WorkerSpec(hang_timeout=bad)


def test_the_flag_and_its_variable_reach_the_config(monkeypatch):
    from etcdrun.agent.cli import parse_args

    config, _, _ = parse_args(["--standalone", "--hang-timeout", "7.5", "train.py"])
    assert config.hang_timeout == 7.5
    monkeypatch.setenv("PET_HANG_TIMEOUT", "12")
    config, _, _ = parse_args(["--standalone", "train.py"])
    assert config.hang_timeout == 12
    monkeypatch.delenv("PET_HANG_TIMEOUT")
    config, _, _ = parse_args(["--standalone", "train.py"])
    assert config.hang_timeout is None
    assert config.worker_spec(None, "train.py", ()).hang_timeout is None


def test_workers_get_a_beat_page_and_a_stack_file_only_with_the_watchdog_on(tmp_path):
    """The page also comes with a backend that shares the node's pace (design.md §4d); the
    stack file only with the watchdog.
    """
    from etcdrun.agent.worker.group import _hang_env
    from etcdrun.agent.worker.logdir import WorkerFiles

    files = WorkerFiles.under(str(tmp_path), 3)
    assert _hang_env(WorkerSpec(), files, False) == {}
    assert _hang_env(WorkerSpec(), files, True) == {beat.VAR: files.progress}
    on = _hang_env(WorkerSpec(hang_timeout=5), files, False)
    assert on[beat.VAR] == files.progress
    assert on[stacks.VAR] == f"{int(stacks.SIGNAL)}:{files.stacks}"
    assert Path(files.stacks).parent == Path(files.error_file).parent


def test_a_process_without_the_hook_is_not_killed_by_a_dump(tmp_path):
    """A worker past finalization (faulthandler gone) or started without the hook has no
    handler: the dump's signal would kill it, so it is not sent, and the reason is said.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print(1, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout.readline() == b"1\n"
        assert not stacks.catches(proc.pid, stacks.SIGNAL)
        said = stacks.dump({0: (proc.pid, str(tmp_path / "none.log"))}, timeout=1)[0]
        assert "does not answer stack dumps" in said
        assert proc.poll() is None and stacks.alive(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def test_a_finished_worker_says_so_on_its_page(tmp_path):
    path = str(tmp_path / "progress")
    beat.create(path)
    code = f"from etcdrun.agent.worker import beat; beat.Writer({path!r}).beat(5)"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert beat.read(path).step == beat.FINISHED
