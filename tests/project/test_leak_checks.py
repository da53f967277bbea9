"""The leak checks of conftest.py, run in a pytest sub-process: they must catch what they claim.

Why a sub-process: the inner tests leak on purpose; in-process, their leaks would be ours.
"""

from __future__ import annotations

from pathlib import Path

from layout import TESTS

HERE = TESTS

INNER = """
import subprocess, threading, time
import pytest

def test_leaks_a_thread():
    threading.Thread(target=time.sleep, args=(1.5,), name="leaky-thread", daemon=True).start()

def test_leaks_a_process():
    subprocess.Popen(["sleep", "1.5"])

def test_leaks_an_orphaned_grandchild():
    # the shell exits at once; its background sleep is re-parented (to us: subreaper)
    subprocess.run(["sh", "-c", "sleep 1.7 & exit 0"], check=True)

@pytest.mark.allow_leaks
def test_may_leak():
    subprocess.Popen(["sleep", "1.6"])

def test_etcd_fixture_is_not_a_leak(etcd):
    assert etcd.endpoints

def test_clean():
    subprocess.run(["true"], check=True)
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
"""


def test_leak_checks_catch_threads_and_processes_but_not_fixtures(pytester, monkeypatch, etcd_bin):
    for name in ("conftest.py", "agent_helpers.py", "etcd_helpers.py", "tlsgen.py"):
        pytester.makefile(Path(name).suffix, **{Path(name).stem: (HERE / name).read_text()})
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.setenv("ETCDRUN_LEAK_GRACE", "0.3")
    monkeypatch.setenv("ETCD_BIN", etcd_bin)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers", "-rA")
    out = result.stdout.str()
    result.assert_outcomes(passed=6, errors=3)
    assert "threads still alive: leaky-thread" in out
    assert "child processes still alive: pid" in out and "sleep 1.5" in out
    assert "sleep 1.7" in out
    assert "ERROR at teardown of test_may_leak" not in out
    assert "ERROR at teardown of test_etcd_fixture_is_not_a_leak" not in out
    assert "ERROR at teardown of test_clean" not in out
