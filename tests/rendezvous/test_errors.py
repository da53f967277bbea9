"""Error files (torch's format, both ways) and the ChildFailedError report."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from etcdrun.agent.api import RunResult, WorkerState
from etcdrun.agent.errors import (
    ChildFailedError,
    ProcessFailure,
    read_error_file,
    real_failures,
    record,
    root_cause,
    write_error_json,
)


def torch_file(path: Path, message: str, callstack: str, timestamp: int) -> str:
    """An error file byte for byte as torch's ErrorHandler.record_exception writes it."""
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": callstack, "timestamp": str(timestamp)},
        }
    }
    path.write_text(json.dumps(data))
    return str(path)


def failure(
    tmp_path: Path,
    rank: int,
    exitcode: int = 1,
    *,
    error: tuple | None = None,
    exit_time: float = 1000.0,
    stopped: str | None = None,
) -> ProcessFailure:
    error_file = str(tmp_path / f"error_{rank}.json")
    if error is not None:
        torch_file(Path(error_file), *error)
    f = ProcessFailure(
        local_rank=rank % 2,
        pid=100 + rank,
        exitcode=exitcode,
        error_file=error_file,
        global_rank=rank,
        host="hostA",
        exit_time=exit_time,
    )
    if stopped:
        f.stopped_by_agent, f.stop_signal = True, stopped
    return f


def test_torch_format_is_parsed(tmp_path):
    path = torch_file(
        tmp_path / "e.json",
        "ValueError: bad lr",
        'Traceback (most recent call last):\n  File "t.py", line 3\nValueError\n',
        1700000000,
    )
    f = ProcessFailure(local_rank=0, pid=7, exitcode=1, error_file=path, global_rank=3)
    assert f.has_error_file and f.message == "ValueError: bad lr"
    assert f.traceback.startswith("Traceback") and f.timestamp == 1700000000.0
    assert f.error_time_resolution == 1.0 and f.signal is None and f.signal_name() == "<N/A>"


def test_torch_string_message_shape_is_parsed(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "plain failure", "timestamp": 1700000001}))
    content = read_error_file(str(path))
    assert content.message == "plain failure" and content.timestamp == 1700000001.0


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{not json", "not a valid error file"),
        ("", "empty"),
        ("[1, 2]", "not a valid error file"),
        ('{"message": {"extraInfo": "x"}}', "not a valid error file"),
        ('{"other": 1}', "not a valid error file"),
    ],
)
def test_corrupt_error_file_does_not_crash(tmp_path, text, problem):
    path = tmp_path / "e.json"
    path.write_text(text)
    f = ProcessFailure(
        local_rank=0, pid=7, exitcode=1, error_file=str(path), global_rank=0, exit_time=5.0
    )
    assert problem in f.error_file_problem and not f.has_error_file
    assert f.message == "exited with code 1" and f.timestamp == 5.0
    report = str(ChildFailedError("train", {0: f}))
    assert "unreadable" in report and problem in report


def test_missing_error_file_and_signal_exit(tmp_path):
    f = ProcessFailure(
        local_rank=1,
        pid=9,
        exitcode=-signal.SIGKILL,
        error_file=str(tmp_path / "none.json"),
        global_rank=5,
        exit_time=3.0,
    )
    assert f.error_file_data is None and f.error_file_problem is None
    assert f.signal == "SIGKILL" and "Signal 9 (SIGKILL)" in f.message


def test_record_writes_torchs_format(tmp_path, monkeypatch):
    path = tmp_path / "err.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def main(x):
        raise ValueError(f"bad {x}")

    with pytest.raises(ValueError):
        main(3)
    data = json.loads(path.read_text())
    assert set(data) == {"message"} and set(data["message"]) == {"message", "extraInfo"}
    extra = data["message"]["extraInfo"]
    assert data["message"]["message"] == "ValueError: bad 3"
    assert set(extra) == {"py_callstack", "timestamp", "timestamp_ms"}
    assert "in main" in extra["py_callstack"] and "ValueError: bad 3" in extra["py_callstack"]
    assert "in wrapper" not in extra["py_callstack"]  # starts in the user's code
    assert extra["timestamp"] == str(int(extra["timestamp"]))
    assert int(extra["timestamp"]) <= time.time()
    assert int(extra["timestamp_ms"]) // 1000 == int(extra["timestamp"])
    f = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert f.error_time_resolution == 0.001 and f.message == "ValueError: bad 3"


def test_record_lets_success_and_exit_codes_through(tmp_path, monkeypatch):
    path = tmp_path / "err.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert record(lambda: 5)() == 5
    assert record(lambda: exit(0))() is None

    @record
    def leave():
        raise SystemExit(2)

    with pytest.raises(SystemExit):
        leave()
    assert not path.exists()


def test_record_without_error_file_env_just_raises(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    with pytest.raises(KeyError):
        record(lambda: {}["x"])()


def test_record_forwards_a_nested_launchs_root_cause(tmp_path, monkeypatch):
    child = failure(tmp_path, 2, error=("OSError: disk", "tb", 1700000000))
    mine = tmp_path / "mine.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(mine))

    @record
    def nested():
        raise ChildFailedError("inner", {2: child})

    with pytest.raises(ChildFailedError):
        nested()
    data = json.loads(mine.read_text())
    assert data["message"]["message"] == "OSError: disk" and data["message"]["errorCode"] == 1


def test_root_cause_is_the_first_real_failure_by_time(tmp_path):
    failures = {
        0: failure(tmp_path, 0, -15, exit_time=900.0, stopped="SIGTERM"),  # earliest, but ours
        1: failure(tmp_path, 1, 1, error=("RuntimeError: peer gone", "tb1", 1001)),
        2: failure(tmp_path, 2, -signal.SIGSEGV, exit_time=1000.5),  # crashed first
        3: failure(tmp_path, 3, 1, error=("ValueError: late", "tb3", 1003)),
    }
    err = ChildFailedError("train.py", failures)
    rank, root = err.get_first_failure()
    assert rank == 2 and root.signal == "SIGSEGV"
    text = str(err)
    head, rest = text.split("Other failures:")
    others, stopped = rest.split("Stopped by the agent (not failures):")
    assert "train.py FAILED" in head and "rank 2 (local rank 0) on hostA" in head
    assert "killed by SIGSEGV" in head
    assert "rank 1 " in others and "RuntimeError: peer gone" in others and "rank 3 " in others
    assert others.index("rank 1 ") < others.index("rank 3 ")
    assert "rank 0 " in stopped and "SIGTERM" in stopped and "rank 0 " not in others


def test_root_cause_shows_traceback_from_error_file(tmp_path):
    tb = 'Traceback (most recent call last):\n  File "train.py", line 9, in step\nKeyError: 1\n'
    err = ChildFailedError("t", {4: failure(tmp_path, 4, 1, error=("KeyError: 1", tb, 1000))})
    assert '      File "train.py", line 9, in step' in str(err)
    assert "error     : KeyError: 1" in str(err)


def test_stderr_tail_shown_without_error_file(tmp_path):
    f = failure(tmp_path, 0, 2)
    f.stderr_tail = ("Traceback (most recent call last):", "ZeroDivisionError: x")
    text = str(ChildFailedError("t", {0: f}))
    assert "stderr (last 2 lines" in text and "ZeroDivisionError: x" in text


def test_everyone_stopped_by_the_agent(tmp_path):
    failures = {
        0: failure(tmp_path, 0, -15, exit_time=2.0, stopped="SIGTERM"),
        1: failure(tmp_path, 1, -9, exit_time=1.0, stopped="SIGKILL"),
    }
    err = ChildFailedError("t", failures)
    assert err.get_first_failure()[0] == 1
    assert "No worker failed by itself" in str(err)


def test_error_before_the_agents_signal_is_a_real_failure(tmp_path):
    f = failure(tmp_path, 0, 1, error=("ValueError: x", "tb", 1000))
    assert f.failed_before(1001.0) and not f.failed_before(1000.5)


def test_no_failures_is_refused():
    with pytest.raises(ValueError):
        ChildFailedError("t", {})


def test_one_root_cause_rule_for_the_report_and_the_result(tmp_path):
    """The agent reports ``root_cause`` to the rendezvous; ChildFailedError prints the same."""
    failures = {
        0: failure(tmp_path, 0, -15, exit_time=900.0, stopped="SIGTERM"),
        1: failure(tmp_path, 1, 1, exit_time=1001.0),
        3: failure(tmp_path, 3, 1, exit_time=1000.0),
    }
    result = RunResult(WorkerState.FAILED, failures=failures)
    assert root_cause(failures)[0] == 3 == ChildFailedError("t", failures).get_first_failure()[0]
    assert set(real_failures(failures)) == set(result.real_failures()) == {1, 3}
    with pytest.raises(ValueError):
        root_cause({})


def test_write_error_json_is_torchs_format_and_atomic(tmp_path):
    path = tmp_path / "root_cause.json"
    path.write_text("stale")
    write_error_json(str(path), "RuntimeError: far away", "Traceback ...\n", 1700000000.25)
    content = read_error_file(str(path))
    assert content is not None and content.problem is None
    assert (content.message, content.traceback) == ("RuntimeError: far away", "Traceback ...\n")
    assert content.timestamp == pytest.approx(1700000000.25) and content.resolution == 0.001
    extra = json.loads(path.read_text())["message"]["extraInfo"]
    assert extra["timestamp"] == "1700000000"  # what torch's own reader takes
    assert [p.name for p in tmp_path.iterdir()] == ["root_cause.json"]  # no temp file left
