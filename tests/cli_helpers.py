"""Running the ``etcdrun`` command as a user does, and what a bad input must look like: one
clear line and a non-zero exit. Shared by the agent's end-to-end and bad-input tests.
"""

from __future__ import annotations

import subprocess

from agent_helpers import WORKER, clean_env, etcdrun_bin


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30):
    return subprocess.run(
        [etcdrun_bin(), *args],
        capture_output=True,
        text=True,
        env=env or clean_env(),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def assert_one_clear_line(proc, *needles: str) -> str:
    """Non-zero exit, no traceback, exactly one error line, which names ``needles``."""
    assert proc.returncode not in (0, None), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("etcdrun: error: ")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    # Anything else on stderr is the agent's own short log lines, not a dump.
    others = [ln for ln in proc.stderr.splitlines() if ln not in errors]
    assert all(ln.startswith("[etcdrun ") for ln in others), proc.stderr
    assert len(others) <= 3, proc.stderr
    return errors[0]


def etcd_argv(endpoints: str, conf: str, *rest: str) -> list[str]:
    return [
        "--nnodes",
        "1",
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        endpoints,
        "--rdzv-id",
        "bad",
        "--rdzv-conf",
        conf,
        *rest,
        WORKER,
        "/nonexistent",
        "exit",
    ]
