"""In place on a torch older than 2.14: one line, and the job runs as without ``etcdrun.elastic``
(docs/in-place.md, "Torch versions").

Why: telling a failed collective from the script's own error needs torch 2.14's collective
post-hooks. A user on 2.13 must get a job that runs (its workers restarted at a change, as for
any script that does not opt in) and one line saying why, not a crash. These tests run in
.ci/run's torch 2.13.0 venv (marker ``torch213``) and skip on a newer torch.
"""

from __future__ import annotations

import os
import signal

import pytest
from agent_helpers import SCRIPTS, Job, clean_env, parent, rows_by_pid, wait_for

pytestmark = pytest.mark.torch213
SCRIPT = str(SCRIPTS / "elastic_train.py")


def test_an_old_torch_says_so_once_and_the_job_restarts_its_workers(
    etcd, tmp_path, torch_before_2_14
):
    out = tmp_path / "out"
    out.mkdir()
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="1:2",
        nproc=1,
        conf="lease_ttl=2,last_call_timeout=1",
        extra=("--prewarm", "none", "--log-dir", str(tmp_path / "logs")),
        script=(SCRIPT, str(out), "40", "0.05"),
    )
    try:
        agents = [job.start(env=clean_env()) for _ in range(2)]
        wait_for(
            lambda: len(r := rows_by_pid(out)) == 2 and all(len(x) >= 5 for x in r.values()),
            90,
            "two workers past step 5",
        )
        victim_pid = next(p for p, rows in rows_by_pid(out).items() if rows[-1]["rank"] == 1)
        victim = next(a for a in agents if a.pid == parent(victim_pid))
        os.kill(victim_pid, signal.SIGKILL)
        victim.proc.kill()
        survivor = next(a for a in agents if a is not victim)
        assert survivor.wait(120) == 0, survivor.stderr[-3000:]
    finally:
        job.close()
    said = survivor.stderr.count("is older than 2.14")
    assert said == 2, survivor.stderr[-3000:]  # once per worker: the first and the restarted
    assert len(rows_by_pid(out)) == 3, "the survivor's worker was restarted, as without in place"
