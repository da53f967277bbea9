"""Hot spares: agents beyond max wait without restarting anyone, take a place when one frees —
and are not failures. Found by a new user's trial: a spare exited 1 once ``join_timeout`` passed
while the job ran fine, and exited 1 again ("the run is closed") when the job succeeded, so a
successful job showed a failed pod or task under Kubernetes or Slurm.
"""

from __future__ import annotations

from agent_helpers import Job, clean_env, wait_for

from etcdrun.agent import loop
from etcdrun.agent.api import WorkerState

UNTIL = """
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
(out / f"start_{os.environ['RANK']}_{os.getpid()}").touch()
while not (out / "finish").exists():
    time.sleep(0.05)
"""


def test_a_spare_outlives_join_timeout_and_exits_0_when_the_job_succeeds(etcd, tmp_path):
    script = tmp_path / "until.py"
    script.write_text(UNTIL)
    out = tmp_path / "out"
    job = Job(etcd.endpoints, tmp_path, nnodes="1:1", nproc=1, conf="lease_ttl=2,join_timeout=2")
    try:
        runner = job.start(str(script), str(out), env=clean_env())
        wait_for(lambda: len(list(out.glob("start_*"))) == 1, 30, "the one worker running")
        spare = job.start(str(script), str(out), env=clean_env())
        # The spare waits past its join_timeout (2 s) while the job runs: two status lines are
        # 10 s (the agent says where it stands every 5 s).
        wait_for(lambda: spare.stderr.count("waiting for a round") >= 2, 30, "the spare waiting")
        assert spare.proc.poll() is None, spare.stderr
        (out / "finish").touch()  # the job's work is done
        assert runner.wait(60) == 0, runner.stderr
        assert spare.wait(60) == 0, spare.stderr
        assert "without needing this node" in spare.stderr
        assert len(list(out.glob("start_*"))) == 1  # the spare started no worker
    finally:
        job.close()


def test_the_loop_returns_success_when_the_run_closed_succeeded_without_this_node():
    state = loop.State(loop.Phase.JOINING)
    step = loop.next_step(state, loop.RunClosed(None, succeeded=True))
    assert isinstance(step.action, loop.ReturnResult)
    assert step.action.result.state == WorkerState.SUCCEEDED and "without needing" in (
        step.action.note
    )
    assert isinstance(loop.next_step(state, loop.RunClosed(None)).action, loop.RaiseClosed)
