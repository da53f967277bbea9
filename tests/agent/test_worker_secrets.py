"""User code never gets the job's etcd credentials (issue 11): not in the workers' environment,
nor in anything the agent writes (agent.log, events.jsonl, error files, worker logs), nor in
``etcdrun status``, nor in the line an auth failure gives.

Measured before: a worker's ``os.environ`` held ``ETCDCTL_PASSWORD`` (or ``ETCDCTL_USER`` as
``user:password``) exactly as the agent had it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from agent_helpers import SCRIPTS, WORKER, clean_env, etcdrun_bin
from cli_helpers import assert_one_clear_line, run_cli
from etcd_helpers import require_local

from etcdrun.agent.config import LaunchConfig
from etcdrun.agent.launcher import elastic_launch
from etcdrun.agent.worker.credentials import scrubbed
from etcdrun.rendezvous.client import EtcdClient

sys.path.insert(0, str(SCRIPTS))
import e2e_callables  # noqa: E402

PW = "Pw-4f9c1e-secret"  # distinctive: a grep for it finds nothing else


def test_what_is_scrubbed_and_what_is_kept():
    env = {
        "ETCDCTL_PASSWORD": PW,
        "ETCDCTL_USER": "bob",
        "ETCDCTL_CACERT": "/ca.pem",
        "ETCDCTL_CERT": "/c.pem",
        "ETCDCTL_KEY": "/k.pem",
        "PET_RDZV_CONF": "lease_ttl=2,password=x",
        "MY_COPY": f"--token {PW}",
        "HOME": "/root",
    }
    assert scrubbed(env) == {"ETCDCTL_USER": "bob", "ETCDCTL_CACERT": "/ca.pem", "HOME": "/root"}
    assert scrubbed({"ETCDCTL_USER": f"bob:{PW}", "X": PW, "Y": "1"}) == {"Y": "1"}


def _enable_auth(endpoints: str) -> None:
    """root, and bob whose role covers etcdrun's prefix."""
    with EtcdClient(endpoints) as admin:
        admin.user_add("root", "rootpw")
        admin.user_grant_role("root", "root")
        admin.role_add("jobs")
        admin.role_grant_prefix("jobs", "/etcdrun/")
        admin.user_add("bob", PW)
        admin.user_grant_role("bob", "jobs")
        admin.auth_enable()


HOW = {
    "ETCDCTL_USER=user:password": {"ETCDCTL_USER": f"bob:{PW}"},
    "ETCDCTL_PASSWORD": {"ETCDCTL_USER": "bob", "ETCDCTL_PASSWORD": PW},
    "PET_RDZV_CONF": {"PET_RDZV_CONF": f"lease_ttl=2,user=bob,password={PW}"},
}


def _no_password_in(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files, root
    return [p for p in files if PW.encode() in p.read_bytes()]


@pytest.mark.parametrize("how", list(HOW))
def test_workers_and_logs_never_see_the_etcd_password(etcd, tmp_path, how):
    require_local(etcd)  # enabling auth on someone else's etcd is not a test's business
    _enable_auth(etcd.endpoints)
    env = clean_env(**HOW[how])
    logs, out = tmp_path / "logs", tmp_path / "out"
    out.mkdir()
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "sec"]
    if how != "PET_RDZV_CONF":
        rdzv += ["--rdzv-conf", "lease_ttl=2"]
    argv = ["--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0", "--tee", "3"]
    proc = run_cli(*argv, *rdzv, "--log-dir", str(logs), WORKER, str(out), "fail", "1", env=env)
    assert proc.returncode == 1, proc.stderr  # rank 1 raised: the agent really logged in
    starts = sorted(out.glob("start_*.json"))
    assert len(starts) == 2, proc.stderr
    for start in starts:
        seen = json.loads(start.read_text())["env"]
        assert PW not in json.dumps(seen), sorted(seen)
        assert seen.get("ETCDCTL_USER") in (None, "bob")  # a bare user name is kept
    assert list(logs.rglob("error.json")) and (logs / "events.jsonl").exists()
    assert _no_password_in(logs) == []  # agent.log, events, error files, worker logs
    assert PW not in proc.stderr + proc.stdout
    status = subprocess.run(
        [etcdrun_bin(), "status", *rdzv[2:]], capture_output=True, text=True, env=env, timeout=30
    )
    assert "sec" in status.stdout + status.stderr and PW not in status.stdout + status.stderr


def test_a_refused_login_never_shows_the_password(etcd):
    require_local(etcd)
    _enable_auth(etcd.endpoints)
    wrong = PW + "-wrong"
    proc = run_cli(
        "--rdzv-backend",
        "etcd",
        "--rdzv-endpoint",
        etcd.endpoints,
        "--rdzv-id",
        "sec",
        "--rdzv-conf",
        "retry_timeout=3",
        WORKER,
        "/nonexistent",
        "exit",
        env=clean_env(ETCDCTL_USER=f"bob:{wrong}"),
    )
    assert_one_clear_line(proc, "authentication failed")
    assert PW not in proc.stderr + proc.stdout


def test_a_forked_callable_worker_gets_no_credentials(tmp_path, monkeypatch):
    """fork and forkserver children inherit the agent's own environment, not one built for
    them: the worker drops the credentials itself.
    """
    monkeypatch.setenv("ETCDCTL_USER", f"bob:{PW}")
    monkeypatch.setenv("ETCDCTL_PASSWORD", PW)
    config = LaunchConfig(run_id="sec", start_method="fork", log_dir=str(tmp_path))
    seen = elastic_launch(config, e2e_callables.environment)()[0]
    assert seen["RANK"] == "0" and PW not in json.dumps(seen)
    assert "ETCDCTL_USER" not in seen and "ETCDCTL_PASSWORD" not in seen
