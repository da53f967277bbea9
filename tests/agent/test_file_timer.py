"""torch's FileTimer under etcdrun: the agent serves the FIFO, torch's own client talks to it.

Two levels: the server against torch's ``FileTimerClient`` in this process (acquire, release,
expiry, a pid that is not ours), and the CLI with ``TORCHELASTIC_ENABLE_FILE_TIMER=1``, where
the worker that overstays its timer is killed and the job's one error line names the scope.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from agent_helpers import SCRIPTS, clean_env, etcdrun_bin, wait_for

from etcdrun.agent.worker.file_timer import Expired, FileTimerServer


@pytest.fixture
def server(tmp_path):
    got: list[Expired] = []
    seen = threading.Event()
    ours = {"pids": set()}

    def on_expired(e: Expired) -> None:
        got.append(e)
        seen.set()

    s = FileTimerServer(str(tmp_path / "timer"))
    s.start(lambda pid: pid in ours["pids"], on_expired)
    s.got, s.seen, s.ours = got, seen, ours
    yield s
    s.close()
    assert not os.path.exists(tmp_path / "timer"), "the FIFO outlived the server"


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_torchs_client_gets_a_worker_killed_when_its_timer_runs_out(server, torch_available):
    from torch.distributed.elastic.timer import FileTimerClient

    proc = sleeper()
    try:
        server.ours["pids"].add(proc.pid)
        client = FileTimerClient(server.path)  # SIGKILL, torch's default
        # torch's client names the calling process; here the request is the worker's own.
        client._send_request(_request(proc.pid, "released", time.time() + 0.2, 9))
        client._send_request(_request(proc.pid, "released", -1, 0))  # a release
        client._send_request(_request(proc.pid, "overstayed", time.time() + 0.3, 9))
        assert proc.wait(10) == -9
        assert [(e.pid, e.scope, e.signum) for e in server.got] == [(proc.pid, "overstayed", 9)]
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_that_is_not_a_worker_is_never_killed(server, torch_available):
    from torch.distributed.elastic.timer import FileTimerClient

    proc = sleeper()
    try:
        FileTimerClient(server.path)._send_request(_request(proc.pid, "x", time.time(), 9))
        time.sleep(0.5)  # nothing must happen: there is no event to wait for
        assert proc.poll() is None and server.got == []
    finally:
        proc.kill()
        proc.wait()


def _request(pid: int, scope: str, expiration: float, signum: int):
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest

    return FileTimerRequest(pid, scope, expiration, signum)


def test_the_cli_serves_the_timer_and_names_the_scope_of_the_failure(tmp_path, torch_available):
    env = clean_env(TORCHELASTIC_ENABLE_FILE_TIMER="1", PET_PREWARM="none")
    proc = subprocess.Popen(
        [
            etcdrun_bin(),
            "--standalone",
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            str(SCRIPTS / "file_timer_worker.py"),
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: (tmp_path / "timer_1").exists(), 60, "rank 1 inside its timer")
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-2000:]
    assert time.monotonic() - t0 < 30, "the stuck rank was not killed by its timer"
    root = err[err.index("Root cause (first failure):") :]
    assert "rank 1 (local rank 1)" in root and "killed by SIGKILL" in root, err[-2000:]
    assert "error     : FileTimer scope 'stuck-in-step' expired" in root, err[-2000:]
    assert "quick-step" not in err
