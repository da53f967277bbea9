"""Fixtures that start real etcd servers, and the leak checks every test passes through.

Leak checks (threads, child processes) run after *all* of a test's fixtures are torn down, so a
leak is the code's, not a fixture's half-finished teardown. A test that leaks on purpose says so
with ``@pytest.mark.allow_leaks``. etcd processes started through ``owned_local_etcd`` (any
scope) are owned by their fixture, which checks them gone itself.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import Job
from etcd_helpers import ExternalEtcd, owned_local_etcd, owned_pids, pid_alive
from tlsgen import TlsFiles, generate

from etcdrun.rendezvous.localetcd import LocalEtcd, TlsConfig, find_etcd

pytest_plugins = ["pytester"]  # tests/project/test_leak_checks.py runs the checks in a sub-session

# Seconds a thread / child may take to finish after teardown (env: for the checks' own tests).
LEAK_GRACE = float(os.environ.get("ETCDRUN_LEAK_GRACE", "3.0"))
_BEFORE = pytest.StashKey[tuple[set[threading.Thread], set[int]]]()


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "allow_leaks: the test may leave threads or child processes behind"
    )
    config.addinivalue_line(
        "markers", "compose: runs deploy/docker-compose.yml for real (needs Docker and compose)"
    )
    config.addinivalue_line(
        "markers", "chaos: seeded chaos trials on real etcd and agents (tests/chaos/, ~60 s)"
    )
    config.addinivalue_line(
        "markers",
        "torch213: about torch older than 2.14 (in place's gate); .ci/run runs them in its "
        "torch 2.13.0 venv, and they skip on a newer torch",
    )
    config.addinivalue_line(
        "markers", "ddp: examples/ddp_elastic.py under real agents and torchrun (needs torch)"
    )
    _prewarm_switch()
    _signals_as_in_a_terminal()
    # Become a child subreaper: orphans of our children (a worker whose agent was killed -9)
    # are re-parented to the test process instead of init, so the leak check still sees them.
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _prewarm_switch() -> None:
    """``ETCDRUN_TEST_PREWARM=none|auto|...``: the suite's ``--prewarm``; unset, ``none``.

    Why off by default: a standby imports torch ahead of each round (``auto``), and on a small
    CI machine those imports are much of what the tests that are not about standbys wait for.
    The standby tests ask for standbys themselves (``--prewarm json``, ``slow_warm``, ...).
    Why the switch: a standby-run worker must be invisible, so ``ETCDRUN_TEST_PREWARM=auto``
    runs every other test with standbys on, and every test passes either way. The value
    reaches in-process LaunchConfigs and WorkerSpecs (their default) and every ``etcdrun``
    the tests start (``PET_PREWARM``, the flag's variable; agent_helpers.suite_prewarm).
    """
    from etcdrun.agent import flags

    flags.DEFAULT_PREWARM = flags.parse_prewarm(os.environ.get("ETCDRUN_TEST_PREWARM") or "none")
    os.environ["PET_PREWARM"] = flags.DEFAULT_PREWARM


def _signals_as_in_a_terminal() -> None:
    """SIGINT and SIGQUIT back to their defaults when the suite started with them ignored.

    Why: a non-interactive shell starts a background job (``pytest &``, ``nohup``, some CI
    runners) with both ignored, and an ignored signal stays ignored across fork and exec, so
    every agent and worker the tests start would ignore them too: the tests that send SIGINT
    (a worker group's ``signal_all``, the demo's Ctrl-C) then wait out their timeouts and fail.
    """
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) == signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


# --- leak checks ------------------------------------------------------------------------------
def _children(root: int) -> set[int]:
    """Live (non-zombie) descendants of ``root``, from /proc/<pid>/task/*/children."""
    found: set[int] = set()
    stack = [root]
    while stack:
        pid = stack.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                kids = (task / "children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                if kid not in found:
                    found.add(kid)
                    stack.append(kid)
    return {pid for pid in found if pid_alive(pid)}


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    item.stash[_BEFORE] = (set(threading.enumerate()), _children(os.getpid()))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    result = yield  # every function fixture is finalized past this point
    if _BEFORE in item.stash and item.get_closest_marker("allow_leaks") is None:
        threads_before, children_before = item.stash[_BEFORE]
        deadline = time.monotonic() + LEAK_GRACE
        while True:
            threads = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
            procs = _children(os.getpid()) - children_before - owned_pids()
            if (not threads and not procs) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        problems = []
        if threads:
            problems.append("threads still alive: " + ", ".join(sorted(t.name for t in threads)))
        if procs:
            problems.append(
                "child processes still alive: "
                + "; ".join(f"pid {pid}: {_cmdline(pid)}" for pid in sorted(procs))
            )
        if problems:
            pytest.fail(f"leak after {item.nodeid}: " + " | ".join(problems), pytrace=False)
    return result


@pytest.fixture
def torch_before_2_14(torch_available) -> None:
    """A torch older than 2.14, for the in-place gate's tests (marker ``torch213``): on a newer
    torch they skip, since .ci/run runs them in its torch 2.13.0 venv.
    """
    from importlib.metadata import version

    major, minor = (int(x) for x in version("torch").split("+")[0].split(".")[:2])
    if (major, minor) >= (2, 14):
        pytest.skip(f"needs torch < 2.14 (this is {version('torch')}): .ci/run's torch 2.13 step")


@pytest.fixture
def torch_available() -> None:
    """torch (a test extra, never a runtime dependency): missing skips locally, FAILS in CI."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        msg = "torch is not installed (pip install -e '.[test]' brings torch==2.14.1)"
        if _in_ci():
            pytest.fail(f"{msg} [CI=true: a missing torch is an error]", pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def compose_images() -> dict[str, str]:
    """Docker, a compose CLI, and the images built by deploy/images/build.py (once a session;
    the build is keyed by content, so later sessions reuse it). Missing: skip locally, FAIL in
    CI (where .ci/run installs docker.io and docker-compose and starts dockerd).
    """
    from compose_helpers import build_images, docker_problem

    problem = docker_problem()
    if problem is not None:
        if _in_ci():
            pytest.fail(f"{problem} [CI=true: missing Docker is an error]", pytrace=False)
        pytest.skip(problem)
    return build_images()


# --- etcd fixtures ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def etcd_bin() -> str:
    """The etcd binary. Missing: skip locally, FAIL in CI (a skip there would hide it)."""
    try:
        path = find_etcd()
    except RuntimeError as err:  # $ETCD_BIN set but wrong: never fall back silently
        pytest.fail(str(err), pytrace=False)
    if path is None:
        msg = "etcd not found: set ETCD_BIN or install etcd (apt-get install etcd-server)"
        if _in_ci():
            pytest.fail(f"{msg} [CI=true: a missing etcd is an error]", pytrace=False)
        pytest.skip(msg)
    return path


@pytest.fixture
def etcd(request: pytest.FixtureRequest) -> Iterator[LocalEtcd | ExternalEtcd]:
    """A fresh single-member etcd, or the external one named by ``ETCDRUN_TEST_ENDPOINTS``.

    Tests that kill or restart members call ``etcd_helpers.require_local(etcd)`` first.
    """
    external = os.environ.get("ETCDRUN_TEST_ENDPOINTS", "").strip()
    if external:
        yield ExternalEtcd(external)
        return
    with owned_local_etcd(members=1, etcd_bin=request.getfixturevalue("etcd_bin")) as e:
        yield e


@pytest.fixture
def etcd_cluster(etcd_bin: str) -> Iterator[LocalEtcd]:
    """Three members on fast timings (a new leader ~0.15 s after a kill -9)."""
    with owned_local_etcd(members=3, etcd_bin=etcd_bin) as e:
        yield e


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """CA, server and client certs (session-wide: generating them per test buys nothing)."""
    return generate(tmp_path_factory.mktemp("tls"))


def _tls(files: TlsFiles, client_cert_auth: bool) -> TlsConfig:
    return TlsConfig(
        ca_file=files.ca_file,
        cert_file=files.server_cert,
        key_file=files.server_key,
        client_cert_auth=client_cert_auth,
        client_cert_file=files.client_cert,
        client_key_file=files.client_key,
    )


@pytest.fixture
def etcd_tls(etcd_bin: str, tls_files: TlsFiles) -> Iterator[LocalEtcd]:
    """Server TLS (https client URL); any client trusting the CA may connect. See ``.tls``."""
    with owned_local_etcd(etcd_bin=etcd_bin, tls=_tls(tls_files, False)) as e:
        yield e


@pytest.fixture
def etcd_mtls(etcd_bin: str, tls_files: TlsFiles) -> Iterator[LocalEtcd]:
    """Server TLS plus client-cert auth: ``.tls.client_cert_file``/``client_key_file`` pass."""
    with owned_local_etcd(etcd_bin=etcd_bin, tls=_tls(tls_files, True)) as e:
        yield e


@pytest.fixture
def etcd_auth_ttl(etcd_bin: str) -> Iterator[LocalEtcd]:
    """Simple auth tokens expire after 2 s idle; the test enables auth via the admin RPCs."""
    with owned_local_etcd(etcd_bin=etcd_bin, auth_token_ttl=2) as e:
        yield e


@pytest.fixture
def job_factory(etcd, tmp_path):
    """Jobs of real agents on the test's etcd (agent_helpers.Job), each closed at the end."""
    jobs: list[Job] = []

    def make(**kw) -> Job:
        j = Job(etcd.endpoints, tmp_path / f"job{len(jobs)}", **kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.close()
