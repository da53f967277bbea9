"""The worker runtime on real processes (no etcd): env, entrypoints, logs, stop, orphans."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from layout import TESTS

from etcdrun.agent.api import EntrypointKind, Std, WorkerSpec, WorkerState, to_map
from etcdrun.agent.errors import ChildFailedError
from etcdrun.agent.worker.group import WorkerGroup
from etcdrun.rendezvous.api import RendezvousInfo

WORKERS = TESTS / "workers"
HOST = socket.gethostname()  # torch 2.14's ${hostname}: the short name
sys.path.insert(0, str(WORKERS))  # wr_callables: importable here and in spawned workers

import wr_callables  # noqa: E402
from etcd_helpers import pid_alive  # noqa: E402


def make_info(
    *,
    first: int = 0,
    world: int = 2,
    node_rank: int = 0,
    nodes: int = 1,
    round: int = 0,
    restarts: int = 0,
    max_restarts: int = 0,
    run_id: str = "job",
) -> RendezvousInfo:
    return RendezvousInfo(
        run_id=run_id,
        round=round,
        node_id=f"node{node_rank}",
        node_rank=node_rank,
        node_count=nodes,
        first_global_rank=first,
        world_size=world,
        master_addr="10.1.2.3",
        master_port=29511,
        restart_count=restarts,
        max_restarts=max_restarts,
    )


def script(name: str) -> str:
    return str(WORKERS / name)


class Console:
    """Binary sinks the relay writes the console lines to."""

    def __init__(self) -> None:
        self.out, self.err = io.BytesIO(), io.BytesIO()


@pytest.fixture
def console() -> Console:
    return Console()


@pytest.fixture
def group(tmp_path: Path, console: Console):
    g = WorkerGroup(str(tmp_path / "logs"), console_out=console.out, console_err=console.err)
    yield g
    g.stop(grace=5)


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def run_to_end(group: WorkerGroup, spec: WorkerSpec, info: RendezvousInfo, attempt=None):
    group.start(spec, info, attempt)
    result = group.wait(60)
    assert result is not None, "workers did not finish"
    final = group.stop(grace=5)
    assert final.state == result.state
    return final


# ---- environment ---------------------------------------------------------------------------------


def test_every_env_var_for_two_workers(group, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    out = tmp_path / "env"
    out.mkdir()
    info = make_info(
        first=4, world=6, node_rank=2, nodes=3, round=7, restarts=2, max_restarts=5, run_id="envjob"
    )
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        entrypoint=script("dump_env.py"),
        args=(str(out), "--lr", 0.5),
        max_restarts=1,  # the rendezvous' budget (info) is what workers see, not the spec's
    )
    result = run_to_end(group, spec, info)
    assert result.state == WorkerState.SUCCEEDED
    assert result.return_values == {4: None, 5: None}
    for local_rank in (0, 1):
        rank = 4 + local_rank
        data = json.loads((out / f"env_{rank}.json").read_text())
        env = data["env"]
        expected = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": "6",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "2",
            "GROUP_WORLD_SIZE": "3",
            "ROLE_NAME": "trainer",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": "6",
            "MASTER_ADDR": "10.1.2.3",
            "MASTER_PORT": "29511",
            "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_MAX_RESTARTS": "5",
            "TORCHELASTIC_RUN_ID": "envjob",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": group.log_paths[rank].error_file,
            "OMP_NUM_THREADS": "1",
            "ETCDRUN_ROUND": "7",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        }
        assert {k: env.get(k) for k in expected} == expected
        assert data["argv"] == [str(out), "--lr", "0.5"]
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"envjob/attempt_7/{rank}/error.json")


def test_user_omp_num_threads_is_kept(group, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    out = tmp_path / "env"
    out.mkdir()
    run_to_end(
        group,
        WorkerSpec(local_world_size=2, entrypoint=script("dump_env.py"), args=(str(out),)),
        make_info(),
    )
    assert json.loads((out / "env_1.json").read_text())["env"]["OMP_NUM_THREADS"] == "4"


def test_single_worker_gets_no_omp_default(group, tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = tmp_path / "env"
    out.mkdir()
    run_to_end(
        group,
        WorkerSpec(local_world_size=1, entrypoint=script("dump_env.py"), args=(str(out),)),
        make_info(world=1),
    )
    assert "OMP_NUM_THREADS" not in json.loads((out / "env_0.json").read_text())["env"]


def test_worker_is_its_own_session_and_process_group(group, tmp_path):
    out = tmp_path / "env"
    out.mkdir()
    group.start(
        WorkerSpec(local_world_size=1, entrypoint=script("sleeper.py"), args=(str(out),)),
        make_info(world=1),
    )
    assert wait_for(lambda: (out / "ready_0").exists())
    pid = group.pids()[0]
    assert int((out / "ready_0").read_text()) == pid  # the shim exec'd: same pid as the worker
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid
    group.stop(grace=5)


# ---- entrypoints ---------------------------------------------------------------------------------


def test_module_entrypoint(group, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(WORKERS))
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint="mod_worker",
        args=(str(tmp_path), "a", 1),
        entrypoint_kind="module",
    )
    assert run_to_end(group, spec, make_info()).state == WorkerState.SUCCEEDED
    assert (tmp_path / "mod_1").read_text() == "__main__ a 1"


def test_executable_entrypoint(group, tmp_path):
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint="sh",
        args=("-c", 'echo "$RANK/$WORLD_SIZE" > "$0/exe_$RANK"', str(tmp_path)),
        entrypoint_kind=EntrypointKind.EXECUTABLE,
    )
    assert run_to_end(group, spec, make_info()).state == WorkerState.SUCCEEDED
    assert (tmp_path / "exe_0").read_text() == "0/2\n"
    assert (tmp_path / "exe_1").read_text() == "1/2\n"


def test_missing_executable_fails_127_with_message(group):
    spec = WorkerSpec(local_world_size=1, entrypoint="/nonexistent/etcdrun-no-such-binary")
    result = run_to_end(group, spec, make_info(world=1))
    failure = result.failures[0]
    assert result.is_failed() and failure.exitcode == 127 and not failure.stopped_by_agent
    assert any("cannot execute" in line for line in failure.stderr_tail)


def test_run_path_entrypoint(group, tmp_path):
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=script("run_path_target.py"),
        args=(str(tmp_path), "x"),
        entrypoint_kind="run_path",
    )
    assert run_to_end(group, spec, make_info()).state == WorkerState.SUCCEEDED
    assert (tmp_path / "runpath_1").read_text() == f"{tmp_path} x"


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_callable_return_values(group, console, method):
    spec = WorkerSpec(
        local_world_size=2, entrypoint=wr_callables.scaled_rank, args=(10,), start_method=method
    )
    info = make_info(first=2, world=4, round=3)
    result = run_to_end(group, spec, info)
    assert result.state == WorkerState.SUCCEEDED
    assert {r: v["value"] for r, v in result.return_values.items()} == {2: 20, 3: 30}
    env = result.return_values[3]["env"]
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "ETCDRUN_ROUND": "3",
        "TORCHELASTIC_ERROR_FILE": group.log_paths[3].error_file,
    }
    if method != "forkserver":
        assert result.return_values[2]["ppid"] == os.getpid()
    lines = console.out.getvalue().splitlines()
    assert b"callable rank 2" in lines and b"callable rank 3" in lines  # untee'd: no prefix


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_callable_exception_is_recorded(group, method):
    spec = WorkerSpec(
        local_world_size=2, entrypoint=wr_callables.raise_on_rank, args=(1,), start_method=method
    )
    group.start(spec, make_info())
    assert group.wait(60).is_failed()
    final = group.stop(grace=5)
    err = ChildFailedError("raise_on_rank", final.failures)
    rank, root = err.get_first_failure()
    assert rank == 1 and root.message == "KeyError: 'callable failed on rank 1'"
    assert "raise_on_rank" in root.traceback
    assert final.failures[0].stopped_by_agent


def test_unpicklable_spawn_entrypoint_fails_start_cleanly(group):
    spec = WorkerSpec(local_world_size=1, entrypoint=lambda: 1, start_method="spawn")
    with pytest.raises(ValueError, match="cannot pickle the entrypoint"):
        group.start(spec, make_info(world=1))
    assert group.relay_thread is None or not group.relay_thread.is_alive()


def test_forked_worker_does_not_inherit_the_agents_signal_handlers(group, tmp_path):
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # an agent forwarding SIGTERM
    try:
        spec = WorkerSpec(
            local_world_size=1,
            entrypoint=wr_callables.sleep_forever,
            args=(str(tmp_path),),
            start_method="fork",
        )
        group.start(spec, make_info(world=1))
        assert wait_for(lambda: (tmp_path / "ready_0").exists())
        final = group.stop(grace=10)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert final.failures[0].signal == "SIGTERM"  # not SIGKILL after sitting out the grace


def test_spawn_failure_inside_start_leaves_nothing_behind(group):
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=wr_callables.scaled_rank,
        args=(lambda: 1,),
        start_method="forkserver",
    )
    with pytest.raises(Exception, match="pickle"):
        group.start(spec, make_info())
    assert not group.relay_thread.is_alive()
    assert group.poll().state == WorkerState.STOPPED


def test_unpicklable_return_value_is_a_failure(group):
    spec = WorkerSpec(
        local_world_size=1, entrypoint=wr_callables.unpicklable_result, start_method="fork"
    )
    result = run_to_end(group, spec, make_info(world=1))
    assert result.is_failed() and "cannot be pickled" in result.failures[0].message


def test_start_while_running_is_refused(group, tmp_path):
    spec = WorkerSpec(local_world_size=1, entrypoint=script("sleeper.py"), args=(str(tmp_path),))
    group.start(spec, make_info(world=1))
    with pytest.raises(RuntimeError, match="stop"):
        group.start(spec, make_info(world=1, round=1))
    group.stop(grace=5)


# ---- failures ------------------------------------------------------------------------------------


def test_record_root_cause_and_stopped_sibling(group):
    spec = WorkerSpec(local_world_size=2, entrypoint=script("fail_rank.py"), args=(1,))
    group.start(spec, make_info())
    first = group.wait(60)
    assert first is not None and first.is_failed() and set(first.real_failures()) == {1}
    final = group.stop(grace=10)
    assert final.is_failed()
    err = ChildFailedError("fail_rank.py", final.failures)
    rank, root = err.get_first_failure()
    assert (rank, root.exitcode, root.host) == (1, 1, group.host)
    assert root.message == "ValueError: boom from rank 1"
    assert "train_step" in root.traceback and root.error_file == group.log_paths[1].error_file
    sibling = final.failures[0]
    assert sibling.stopped_by_agent and sibling.stop_signal == "SIGTERM"
    assert sibling.signal == "SIGTERM"
    text = str(err)
    root_part, stopped_part = text.split("Stopped by the agent (not failures):")
    assert "rank 1 (local rank 1)" in root_part and "boom from rank 1" in root_part
    assert "rank 0 (local rank 0)" in stopped_part and "rank 0" not in root_part
    assert "Other failures" not in text


def test_torch_written_error_file_is_parsed(group):
    spec = WorkerSpec(local_world_size=1, entrypoint=script("torch_error.py"))
    result = run_to_end(group, spec, make_info(world=1))
    failure = result.failures[0]
    assert failure.message == "RuntimeError: torch-style failure"
    assert "failing" in failure.traceback and failure.error_time_resolution == 1.0


def test_signal_death_is_named(group, tmp_path):
    spec = WorkerSpec(local_world_size=1, entrypoint="sh", args=("-c", "kill -SEGV $$"))
    result = run_to_end(group, spec, make_info(world=1))
    failure = result.failures[0]
    assert failure.exitcode == -signal.SIGSEGV and failure.signal == "SIGSEGV"
    assert not failure.stopped_by_agent
    assert "killed by SIGSEGV" in str(ChildFailedError("sh", result.failures))


# ---- logs ----------------------------------------------------------------------------------------


def read(path: str) -> bytes:
    return Path(path).read_bytes() if os.path.exists(path) else b""


def test_default_goes_to_console_unprefixed_without_files(group, console):
    """As under torchrun, whose untee'd workers write to the console themselves."""
    run_to_end(group, WorkerSpec(local_world_size=2, entrypoint=script("output.py")), make_info())
    assert sorted(console.out.getvalue().splitlines()) == [b"out 0", b"out 1"]
    assert sorted(console.err.getvalue().splitlines()) == [b"err 0", b"err 1"]
    assert not os.path.exists(group.log_paths[0].stdout)


def test_tee_writes_files_and_console(group, console):
    run_to_end(
        group, WorkerSpec(local_world_size=2, entrypoint=script("output.py"), tee=3), make_info()
    )
    assert b"[default1]:out 1" in console.out.getvalue().splitlines()  # torchrun's tee prefix
    assert read(group.log_paths[1].stdout) == b"out 1\n"
    assert read(group.log_paths[1].stderr) == b"err 1\n"


def test_redirect_writes_files_only(group, console):
    run_to_end(
        group,
        WorkerSpec(local_world_size=2, entrypoint=script("output.py"), redirects=Std.ALL),
        make_info(),
    )
    assert console.out.getvalue() == b"" and console.err.getvalue() == b""
    assert read(group.log_paths[0].stdout) == b"out 0\n"
    assert read(group.log_paths[0].stderr) == b"err 0\n"


def test_per_rank_redirect_map(group, console):
    run_to_end(
        group,
        WorkerSpec(local_world_size=2, entrypoint=script("output.py"), redirects="0:1"),
        make_info(),
    )
    assert console.out.getvalue().splitlines() == [b"out 1"]
    assert sorted(console.err.getvalue().splitlines()) == [b"err 0", b"err 1"]
    assert read(group.log_paths[0].stdout) == b"out 0\n"


def test_local_ranks_filter_keeps_filtered_output_in_files(group, console):
    spec = WorkerSpec(
        local_world_size=2, entrypoint=script("output.py"), tee=Std.OUT, local_ranks_filter={1}
    )
    run_to_end(group, spec, make_info(first=4, world=6))
    assert console.out.getvalue().splitlines() == [b"[default1]:out 5"]  # role, local rank
    assert console.err.getvalue().splitlines() == [b"err 5"]
    assert read(group.log_paths[4].stdout) == b"out 4\n"
    assert read(group.log_paths[4].stderr) == b"err 4\n"


def test_global_ranks_filter(group, console):
    spec = WorkerSpec(local_world_size=2, entrypoint=script("output.py"), global_ranks_filter="4")
    run_to_end(group, spec, make_info(first=4, world=6))
    assert console.out.getvalue().splitlines() == [b"out 4"]


def test_binary_and_partial_lines_do_not_break_the_relay(group, console):
    spec = WorkerSpec(
        local_world_size=1, entrypoint=script("output.py"), args=("binary",), tee=Std.OUT
    )
    assert run_to_end(group, spec, make_info(world=1)).state == WorkerState.SUCCEEDED
    raw = b"out 0\n\xff\xfe\x00bin\r\n" + b"x" * 10 + b" no newline"
    assert read(group.log_paths[0].stdout) == raw
    lines = raw.split(b"\n")
    assert console.out.getvalue() == b"".join(b"[default0]:" + line + b"\n" for line in lines)


@pytest.mark.parametrize(
    "template, tee, out",
    [
        ("[${rank}]:", None, [b"[4]:out 4", b"[5]:out 5"]),  # torch's own example
        ("${role_name}/${local_rank}/${rank} ", 3, [b"trainer/0/4 out 4", b"trainer/1/5 out 5"]),
        ("[$nothing]", None, [b"[$nothing]out 4", b"[$nothing]out 5"]),  # safe_substitute
        ("${hostname}:${rank}: ", None, [f"{HOST}:4: out 4".encode(), f"{HOST}:5: out 5".encode()]),
    ],
)
def test_log_line_prefix_template(group, console, monkeypatch, template, tee, out):
    """TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (torch's variables); here it prefixes untee'd lines
    too, where torchrun would print them bare.
    """
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", template)
    spec = WorkerSpec(role="trainer", local_world_size=2, entrypoint=script("output.py"), tee=tee)
    run_to_end(group, spec, make_info(first=4, world=6))
    assert sorted(console.out.getvalue().splitlines()) == out
    if tee:
        assert read(group.log_paths[4].stdout) == b"out 4\n"  # files get the raw lines


def test_the_specs_template_wins_over_the_variable(group, console, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[env]")
    spec = WorkerSpec(entrypoint=script("output.py"), log_line_prefix_template="<${rank}>")
    run_to_end(group, spec, make_info(world=1))
    assert console.out.getvalue() == b"<0>out 0\n"


def test_duplicate_filters_copy_matching_teed_lines(group, console):
    """torch's --duplicate-stdout-filters: teed lines holding any filter go, prefixed, to the
    attempt's filtered_stdout.log (all ranks in one file); untee'd ones never do.
    """
    spec = WorkerSpec(
        local_world_size=3,
        entrypoint=script("output.py"),
        tee="0:1,1:1",
        duplicate_stdout_filters=["out 1", "out 2"],
        duplicate_stderr_filters=["err"],
    )
    run_to_end(group, spec, make_info(world=3))
    attempt = Path(group.attempt_dir)
    assert (attempt / "filtered_stdout.log").read_bytes() == b"[default1]:out 1\n"
    assert not (attempt / "filtered_stderr.log").exists()  # no stderr was teed
    assert sorted(console.out.getvalue().splitlines()) == [
        b"[default0]:out 0",
        b"[default1]:out 1",
        b"out 2",
    ]


def test_worker_env_virtual_local_rank_and_signals(monkeypatch):
    from etcdrun.agent.api import Worker
    from etcdrun.agent.worker.spawn import worker_env

    spec = WorkerSpec(local_world_size=4, virtual_local_rank=True, signals_to_handle="SIGUSR1")
    env = worker_env(spec, make_info(world=4), Worker(2, 2, 2, 4, 4), "/e")
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "2")
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGUSR1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7, 5,3,1")
    env = worker_env(spec, make_info(world=4), Worker(1, 1, 1, 4, 4), "/e")
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"]) == ("0", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(ValueError, match="local_rank 1 exceeds available GPUs"):
        worker_env(spec, make_info(world=4), Worker(1, 1, 1, 4, 4), "/e")
    plain = worker_env(WorkerSpec(local_world_size=4), make_info(world=4), Worker(1), "/e")
    assert plain["LOCAL_RANK"] == "1" and "CUDA_VISIBLE_DEVICES" not in plain
    assert plain["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_logs_of_every_attempt_are_kept(group, tmp_path):
    spec = WorkerSpec(local_world_size=2, entrypoint=script("output.py"), redirects=3)
    run_to_end(group, spec, make_info(round=0))
    first = dict(group.log_paths)
    run_to_end(group, spec, make_info(round=1, first=2, world=4))
    second = group.log_paths
    assert Path(first[0].stdout).parent.parent.name == "attempt_0"
    assert Path(second[2].stdout).parent.parent.name == "attempt_1"
    assert read(first[0].stdout) == b"out 0\n" and read(first[1].stderr) == b"err 1\n"
    assert read(second[3].stdout) == b"out 3\n"
    assert sorted(p.name for p in (tmp_path / "logs" / "job").iterdir()) == [
        "attempt_0",
        "attempt_1",
    ]


def test_a_repeated_round_gets_a_new_attempt_folder(group):
    spec = WorkerSpec(local_world_size=1, entrypoint=script("output.py"), redirects=3)
    run_to_end(group, spec, make_info(world=1, round=0))
    run_to_end(group, spec, make_info(world=1, round=0, restarts=1))  # static backend restart
    assert group.attempt == 1 and read(group.log_paths[0].stdout) == b"out 0\n"
    run_to_end(group, spec, make_info(world=1, round=5))
    assert group.attempt == 5


def test_stale_error_file_of_a_previous_run_is_ignored(group):
    spec = WorkerSpec(local_world_size=1, entrypoint="sh", args=("-c", "exit 3"))
    info = make_info(world=1)
    group.start(spec, info, attempt=9)
    group.wait(30)
    group.stop()
    Path(group.log_paths[0].error_file).write_text('{"message": "stale"}')
    result = run_to_end(group, spec, info, attempt=9)
    assert result.failures[0].message == "exited with code 3"


# ---- stop, signals, leaks ------------------------------------------------------------------------


def test_stop_escalates_to_sigkill_for_a_worker_ignoring_sigterm(group, tmp_path):
    spec = WorkerSpec(
        local_world_size=2, entrypoint=script("sleeper.py"), args=(str(tmp_path), "ignore-term")
    )
    group.start(spec, make_info())
    assert wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)))
    final = group.stop(grace=0.5)
    assert final.state == WorkerState.STOPPED and not final.real_failures()
    for rank in (0, 1):
        failure = final.failures[rank]
        assert (tmp_path / f"term_{rank}").exists()  # it got SIGTERM first
        assert failure.exitcode == -signal.SIGKILL and failure.stop_signal == "SIGKILL"
        assert failure.stopped_by_agent


def test_stop_returns_as_soon_as_workers_exit(group, tmp_path):
    spec = WorkerSpec(
        local_world_size=2,
        entrypoint=script("sleeper.py"),
        args=(str(tmp_path), "exit-on-term"),
        stop_grace=60,
    )
    group.start(spec, make_info())
    assert wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)))
    began = time.monotonic()
    final = group.stop()
    assert time.monotonic() - began < 30  # far below the 60 s grace: it did not sit it out
    assert final.state == WorkerState.STOPPED and final.failures == {}
    assert final.return_values == {0: None, 1: None}


def test_signal_all_forwards_and_marks_workers_stopped(group, tmp_path):
    spec = WorkerSpec(local_world_size=2, entrypoint=script("sleeper.py"), args=(str(tmp_path),))
    group.start(spec, make_info())
    assert wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)))
    group.signal_all(signal.SIGINT)
    result = group.wait(30)
    assert result is not None and result.state == WorkerState.STOPPED
    assert {f.stop_signal for f in result.failures.values()} == {"SIGINT"}
    assert all(f.stopped_by_agent for f in result.failures.values())
    assert group.stop().state == WorkerState.STOPPED


def test_on_exit_callback_and_wait(tmp_path):
    seen: list[int] = []
    woke = threading.Event()

    def on_exit(worker):
        seen.append(worker.global_rank)
        woke.set()

    g = WorkerGroup(
        str(tmp_path), on_exit=on_exit, console_out=io.BytesIO(), console_err=io.BytesIO()
    )
    g.start(WorkerSpec(local_world_size=2, entrypoint="sh", args=("-c", "exit 0")), make_info())
    assert woke.wait(30)
    assert g.wait(30).state == WorkerState.SUCCEEDED
    g.stop()
    assert sorted(seen) == [0, 1]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_stop_leaves_no_thread_pipe_or_process(tmp_path):
    before = open_fds()
    g = WorkerGroup(str(tmp_path), console_out=io.BytesIO(), console_err=io.BytesIO())
    spec = WorkerSpec(
        local_world_size=3, entrypoint=script("sleeper.py"), args=(str(tmp_path),), tee="0:3,1:1"
    )
    workers = g.start(spec, make_info(world=3))
    thread = g.relay_thread
    assert thread is not None and thread.is_alive() and len(open_fds()) > len(before)
    g.stop(grace=5)
    assert not thread.is_alive()
    assert open_fds() == before
    for w in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(w.pid, 0)


def test_workers_outlive_the_thread_that_started_them(group, tmp_path):
    spec = WorkerSpec(local_world_size=1, entrypoint=script("sleeper.py"), args=(str(tmp_path),))
    starter = threading.Thread(target=group.start, args=(spec, make_info(world=1)))
    starter.start()
    starter.join()
    assert wait_for(lambda: (tmp_path / "ready_0").exists())
    time.sleep(0.3)  # PR_SET_PDEATHSIG would have fired when `starter` ended
    assert group.poll() is None
    assert group.stop(grace=5).failures[0].stop_signal == "SIGTERM"


AGENT = """
import sys, time
from etcdrun.agent.api import WorkerSpec
from etcdrun.agent.worker.group import WorkerGroup
from etcdrun.rendezvous.api import RendezvousInfo
sys.path.insert(0, sys.argv[4])
import wr_callables
out, kind = sys.argv[1], sys.argv[2]
info = RendezvousInfo(run_id="orphan", round=0, node_id="n", node_rank=0, node_count=1,
                      first_global_rank=0, world_size=2, master_addr="127.0.0.1",
                      master_port=1, restart_count=0)
if kind == "script":
    spec = WorkerSpec(local_world_size=2, entrypoint=sys.argv[3], args=(out,))
else:
    spec = WorkerSpec(local_world_size=2, entrypoint=wr_callables.sleep_forever, args=(out,),
                      start_method=kind)
workers = WorkerGroup(out).start(spec, info)
print(" ".join(str(w.pid) for w in workers), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    return pid_alive(pid)  # an exiting process (PF_EXITING) counts as gone: etcd_helpers


@pytest.mark.parametrize("kind", ["script", "spawn", "fork"])
def test_agent_killed_by_sigkill_leaves_no_orphan(tmp_path, kind):
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path), kind, script("sleeper.py"), str(WORKERS)],
        stdout=subprocess.PIPE,
    )
    try:
        pids = [int(p) for p in agent.stdout.readline().split()]
        assert len(pids) == 2
        assert wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)))
        assert all(alive(pid) for pid in pids)
    finally:
        agent.kill()
        agent.wait()
        agent.stdout.close()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.02)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in pids:  # orphans come to us when the test process is a subreaper: reap them
        try:
            if not alive(pid):
                os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == [], "workers outlived their agent"


# ---- api ---------------------------------------------------------------------------------------


def test_std_parsing():
    assert to_map("3", 2) == {0: Std.ALL, 1: Std.ALL}
    assert to_map("0:1,2:2", 3) == {0: Std.OUT, 1: Std.NONE, 2: Std.ERR}
    assert to_map({1: 2}, 2) == {0: Std.NONE, 1: Std.ERR}
    assert to_map(None, 1) == {0: Std.NONE}
    assert to_map(Std.OUT, 1) == {0: Std.OUT}
    for bad in ("4", "x", "0:", "0:9", "-1:1", 7):
        with pytest.raises(ValueError, match="redirects/tee"):
            to_map(bad, 2)


def test_worker_spec_validation_and_kinds():
    assert WorkerSpec(entrypoint="train.py").resolved_kind() is EntrypointKind.SCRIPT
    assert WorkerSpec(entrypoint="/bin/true").resolved_kind() is EntrypointKind.EXECUTABLE
    assert WorkerSpec(entrypoint=print).resolved_kind() is EntrypointKind.CALLABLE
    assert WorkerSpec(local_ranks_filter="0, 2").local_ranks_filter == frozenset({0, 2})
    with pytest.raises(ValueError, match="local_world_size"):
        WorkerSpec(local_world_size=0)
    with pytest.raises(ValueError, match="start_method"):
        WorkerSpec(start_method="thread")
    with pytest.raises(ValueError, match="entrypoint_kind"):
        WorkerSpec(entrypoint="x", entrypoint_kind="binary")
    with pytest.raises(ValueError, match="string entrypoint"):
        WorkerSpec(entrypoint=print, entrypoint_kind="script")
    with pytest.raises(ValueError, match="redirects/tee"):
        WorkerSpec(tee="5")
    with pytest.raises(ValueError, match="local_ranks_filter"):
        WorkerSpec(local_ranks_filter="a")
    assert WorkerState.is_running(WorkerState.HEALTHY)
    assert not WorkerState.is_running(WorkerState.SUCCEEDED)


def test_rendezvous_info_outside_the_world_is_refused(group):
    spec = WorkerSpec(local_world_size=2, entrypoint="true")
    with pytest.raises(ValueError, match="outside world size"):
        group.start(spec, make_info(first=3, world=4))
