"""A log dir that is read-only or fills up is bad input (issue 11): one clear line, a non-zero
exit (143 after SIGTERM, as ever), and nothing else lost — the console keeps every line.

Real file systems: a 256 KiB tmpfs mounted for the test (``ro`` for read-only: root ignores
chmod) and unmounted in its teardown. Measured before: read-only was an OSError traceback; full
gave a ``--- Logging error ---`` traceback per agent line and SIGTERM exited 1; a
``--redirects`` worker that died of ENOSPC was only ``exit code 1``; ``--tee`` dropped its file
copy silently.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import WORKER, Agent, clean_env, etcdrun_bin, wait_for
from cli_helpers import assert_one_clear_line, etcd_argv, run_cli
from layout import TESTS

CHATTY = str(TESTS / "workers" / "chatty.py")
LINES = 3000  # ~330 KB: more than the whole tmpfs


def _mount(where: Path, options: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("mounting a tmpfs needs root [CI=true: an error]", pytrace=False)
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)  # no mount left behind


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    yield from _mount(tmp_path / "ro", "size=256k,ro")


@pytest.fixture
def full(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with no room left; agent.log and events.jsonl already end 6 bytes short of a
    page (tmpfs allocates by page), so the agent's first lines there find the disk full.
    """
    for d in _mount(tmp_path / "full", "size=256k"):
        for name in ("agent.log", "events.jsonl"):
            (d / name).write_bytes(b"#" * 4090)
        with open(d / "filler", "wb", buffering=0) as fp:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    fp.write(b"\0" * 4096)
        yield d


@pytest.mark.parametrize("sub", ["", "logs"])
def test_a_read_only_log_dir_is_refused_before_anything_starts(read_only, tmp_path, sub):
    log_dir = read_only / sub if sub else read_only
    proc = run_cli("--standalone", "--log-dir", str(log_dir), WORKER, str(tmp_path), "exit")
    assert proc.returncode == 2
    assert_one_clear_line(proc, f"--log-dir {log_dir}: ", "(EROFS)")
    assert "starting" not in proc.stderr  # refused before the rendezvous is joined
    assert not list(tmp_path.glob("start_*.json"))  # no worker ran


def test_a_log_dir_that_fills_up_says_so_once_and_sigterm_still_exits_143(full, tmp_path):
    argv = [etcdrun_bin(), "--standalone", "--log-dir", str(full), "--tee", "3"]
    agent = Agent([*argv, CHATTY, str(LINES), "600"], tmp_path, "agent", clean_env())
    try:
        wait_for(lambda: "done printing" in agent.stdout, 60, "the worker's last line")
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 143, agent.stderr
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
    err = agent.stderr
    assert "Logging error" not in err and "Traceback" not in err, err[-3000:]
    said = [ln for ln in err.splitlines() if "is full (ENOSPC)" in ln]
    assert len(said) == 3, said  # once each: agent.log, events.jsonl, the teed copy
    assert any(f"{full}/agent.log is full (ENOSPC)" in ln for ln in said), said
    assert any(f"{full}/events.jsonl is full (ENOSPC)" in ln for ln in said), said
    # stdout.log, or stderr.log when the first teed line was a standby's import warning
    # (torch without numpy warns at import; a standby replays it first)
    assert any(
        ("stdout.log is full" in ln or "stderr.log is full" in ln)
        and "(ENOSPC): the file copy of teed output stopped" in ln
        for ln in said
    ), said
    teed = [ln for ln in agent.stdout.splitlines() if ln.startswith("[0]:line ")]
    assert len(teed) == LINES  # the console lost nothing (teed lines carry the rank prefix)


def test_a_redirected_worker_killed_by_a_full_disk_says_enospc(full, tmp_path):
    proc = run_cli(
        "--standalone", "--log-dir", str(full), "--redirects", "3", CHATTY, str(LINES), "0"
    )
    assert proc.returncode == 1
    assert "Logging error" not in proc.stderr, proc.stderr
    said = [ln for ln in proc.stderr.splitlines() if "is full (ENOSPC)" in ln]
    assert any(
        f"{full}/" in ln and "the worker's output could not be written" in ln for ln in said
    ), proc.stderr


def test_a_full_log_dir_leaves_the_workers_without_progress_pages_not_the_agent_dead(
    full, tmp_path, etcd
):
    """The etcd backend gives every worker a progress page in the log dir (the node's pace,
    the hang watchdog), and a full disk crashed the agent there with a traceback (issue 44).
    Now it is one line, and the job runs: the workers start and end as without the page.
    """
    out = tmp_path / "out"
    out.mkdir()
    argv = etcd_argv(etcd.endpoints, "lease_ttl=2", "--log-dir", str(full))[:-3]
    proc = run_cli(*argv, WORKER, str(out), "exit", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if "progress pages are off" in ln]
    assert len(said) == 1 and "is full (ENOSPC)" in said[0], proc.stderr[-3000:]
    assert list(out.glob("start_*.json")), "the worker never started"
