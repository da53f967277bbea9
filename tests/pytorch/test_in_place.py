"""Survivors keep running (etcdrun.elastic, design.md §4a): real agents, a real etcd, real gloo.

Three agents of one worker each train tests/agent_scripts/elastic_train.py, where every rank
trains on the same batches: the loss at every step is then that of one process, whatever the
world size, and the test computes it here. A node is killed (-9), the rank-0 node is killed,
a node is frozen past its lease (SIGSTOP), or a fourth node arrives; in each case the
survivors' worker processes must be the ones that started, no step may be done twice, every
step's loss must be the one-process loss within 1e-4, and the agents must say the round was
taken in place (events.jsonl).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from agent_helpers import (
    SCRIPTS,
    Job,
    clean_env,
    etcdrun_bin,
    parent,
    rows_by_pid,
    wait_for,
    warden_of,
)

from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.tools import status

SCRIPT = str(SCRIPTS / "elastic_train.py")
STEPS = 60
EVENT_AT = 8  # steps every worker has done before the event


def reference_losses(steps: int) -> list[float]:
    """The same model, optimizer and batches in one process, no process group."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.002)
    losses = []
    for step in range(steps):
        x = torch.arange(32, dtype=torch.float32).reshape(8, 4) / (step % 7 + 1)
        y = x.sum(1, keepdim=True) * 0.5
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def events(log_dir: Path, name: str) -> list[dict]:
    path = log_dir / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["event"] == name]


def kept_in_etcd(job: Job) -> tuple:
    """The rounds taken in place as `etcdrun status` reads them, once one is there."""
    keys = RunKeys("/etcdrun", job.run_id)
    with EtcdClient(job.endpoints) as c:
        return wait_for(
            lambda: status.read(c, keys, ttls=False).kept_rounds, 30, "a round recorded as kept"
        )


@pytest.fixture
def job(etcd, tmp_path, torch_available):
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    j = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="2:4",
        nproc=1,
        conf="lease_ttl=2,last_call_timeout=1",
        extra=("--prewarm", "none", "--log-dir", str(logs)),
        script=(SCRIPT, str(out), str(STEPS), "0.05"),
    )
    j.steps_dir, j.logs = out, logs
    yield j
    j.close()


@pytest.mark.parametrize("how", ["kill", "kill_rank0", "sigstop", "arrive"])
def test_survivors_keep_their_processes_and_lose_no_step(job, how):
    # a newcomer's agent and its cold worker must join before the survivors' last step: at
    # 0.05 s a step, the 52 steps left after the event took 2.6 s, which a loaded machine's
    # agent start alone can take, and the job then ended in round 1
    pause = "0.25" if how == "arrive" else "0.05"
    script = (SCRIPT, str(job.steps_dir), str(STEPS), pause)
    agents = [job.start(*script, env=clean_env()) for _ in range(3)]
    wait_for(
        lambda: (
            len(rows := rows_by_pid(job.steps_dir)) == 3
            and all(len(r) >= EVENT_AT for r in rows.values())
        ),
        90,
        "three workers past step 8",
    )
    before = rows_by_pid(job.steps_dir)
    by_rank = {rows[-1]["rank"]: pid for pid, rows in before.items()}
    victim_pid = by_rank[0 if how == "kill_rank0" else 2]
    victim = next(a for a in agents if a.pid == parent(victim_pid))
    if how in ("kill", "kill_rank0"):
        os.kill(victim_pid, signal.SIGKILL)
        victim.proc.kill()
    elif how == "sigstop":  # the whole node frozen past its lease (warden too), then gone
        frozen = (victim.pid, victim_pid, warden_of(victim.pid))
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: len(events(job.logs, "workers_regrouped")) >= 2, 30, "the regroup")
        victim.proc.kill()
        os.kill(victim_pid, signal.SIGKILL)
        os.kill(frozen[2], signal.SIGCONT)  # the warden sweeps what is left and leaves
    else:
        agents.append(job.start(*script, env=clean_env()))
    # `etcdrun status` names the round taken in place (the node ranked 0 in it writes it), while
    # the job runs: the last agent out removes the run's keys
    kept_rounds = kept_in_etcd(job)
    survivors = [a for a in agents if a is not victim or how == "arrive"]
    for a in survivors:
        assert a.wait(120) == 0, a.stderr[-3000:]

    after = rows_by_pid(job.steps_dir)
    kept = [pid for pid in before if pid != victim_pid or how == "arrive"]
    reference = reference_losses(STEPS)
    for pid in kept:
        rows = after[pid]
        steps = [r["step"] for r in rows]
        # No step twice. A survivor may not log the round's last step: a peer whose collective
        # completed committed it, and every rank takes that newest commit in the sync.
        first_of_2 = next(i for i, r in enumerate(rows) if r["round"] == 2)
        assert steps[:first_of_2] == list(range(1, first_of_2 + 1)), f"pid {pid}: {steps}"
        assert steps[first_of_2:] == list(range(steps[first_of_2], STEPS + 1)), steps
        assert steps[first_of_2] - first_of_2 in (1, 2), f"pid {pid}: a step skipped, {steps}"
        assert len({r["round"] for r in rows}) == 2, "the same process ran in both rounds"
        for r in rows:
            assert r["loss"] == pytest.approx(reference[r["step"] - 1], rel=1e-4), r
    done = sorted({r["step"] for pid in kept for r in after[pid]})
    assert done == list(range(1, STEPS + 1)), "every step computed, by the survivors together"
    worlds = {after[pid][-1]["world"] for pid in kept}
    assert worlds == ({4} if how == "arrive" else {2})
    if how == "arrive":  # the newcomer took the survivors' state, not step 1's
        (new,) = set(after) - set(before)
        first = after[new][0]["step"]
        assert first > EVENT_AT and [r["step"] for r in after[new]] == list(range(first, 61))
        for r in after[new]:
            assert r["loss"] == pytest.approx(reference[r["step"] - 1], rel=1e-4), r
    regrouped = events(job.logs, "workers_regrouped")
    resumed = events(job.logs, "worker_resumed")
    assert len(regrouped) == len(kept) and len(resumed) == len(kept)
    assert all(e["pause_s"] is not None and e["sync_bytes"] > 0 for e in resumed)
    assert not events(job.logs, "workers_restarted"), "a survivor was restarted"
    rank0 = {e["node"] for e in regrouped if 0 in e["ranks"]}
    assert [(k.round, k.previous_round, k.node) for k in kept_rounds] == [(2, 1, *rank0)]
    assert kept_rounds[0].pause_s is not None


def test_a_newcomer_handed_a_round_as_the_survivors_finish_ends_the_job(job):
    """The survivors' training returns while a newcomer joins (the in-place soak's seed 1067,
    bench/results/soak.md): they never resume in the new round, so nobody would serve the store
    the newcomer's workers wait for. The survivors close the run as SUCCEEDED and the newcomer
    leaves with it, rather than everyone waiting out the exit barrier.
    """
    steps, hold = 12, job.steps_dir / "hold"
    script = (SCRIPT, str(job.steps_dir), str(steps), "0.05", str(hold))
    agents = [job.start(*script, env=clean_env()) for _ in range(2)]
    wait_for_two_done(job, steps)
    newcomer = job.start(*script, env=clean_env())
    frozen = lambda: [e for e in events(job.logs, "round_frozen") if e["round"] == 2]  # noqa: E731
    wait_for(frozen, 60, "round 2 frozen with the newcomer")
    hold.touch()  # the survivors' training function returns now
    for a in [*agents, newcomer]:
        assert a.wait(60) == 0, a.stderr[-3000:]
    assert any("finished the training before they resumed" in a.stderr for a in agents)
    assert "the job finished (SUCCEEDED)" in newcomer.stderr, newcomer.stderr[-3000:]
    rows = rows_by_pid(job.steps_dir)
    assert sorted(len(r) for r in rows.values()) == [steps, steps]  # no step run again
    assert not events(job.logs, "worker_resumed")


def wait_for_two_done(job, steps: int) -> None:
    wait_for(
        lambda: (
            len(rows := rows_by_pid(job.steps_dir)) == 2
            and all(len(r) == steps for r in rows.values())
        ),
        90,
        "two workers done with their last step",
    )


def test_a_newcomer_that_comes_while_the_workers_exit_after_training_restarts_nothing(job):
    """A newcomer came while the workers, their training done, were still exiting (gloo's
    teardown takes seconds): their links had closed, so they no longer counted as kept, and the
    agents restarted them, which trained the whole job again (the in-place soak's seed 13089).
    A worker now says when its training function returns, and the agent waits for its exit.
    """
    steps = 12
    script = (SCRIPT, str(job.steps_dir), str(steps), "0.05")
    env = clean_env(LINGER="15")
    agents = [job.start(*script, env=env) for _ in range(2)]
    wait_for_two_done(job, steps)
    newcomer = job.start(*script, env=env)
    for a in [*agents, newcomer]:
        assert a.wait(90) == 0, a.stderr[-3000:]
    assert not any("restarting workers" in a.stderr for a in agents), agents[0].stderr[-3000:]
    assert "the job finished (SUCCEEDED)" in newcomer.stderr, newcomer.stderr[-3000:]
    rows = rows_by_pid(job.steps_dir)
    assert sorted(len(r) for r in rows.values()) == [steps, steps]  # nothing trained again


def test_a_drained_node_leaves_at_its_workers_next_commit_and_no_step_is_redone(job):
    """Committing every 10 steps: the drained node's workers stop just after a commit, so the
    survivors, whose collective then breaks, go back to that same commit and redo nothing.
    Stopped mid-interval, as before, every survivor redid the steps since its last commit.
    """
    env, steps = clean_env(COMMIT_EVERY="10"), 200  # long enough for the drain to come first
    script = (SCRIPT, str(job.steps_dir), str(steps), "0.02")
    agents = [job.start(*script, env=env) for _ in range(3)]
    wait_for(
        lambda: (
            len(rows := rows_by_pid(job.steps_dir)) == 3
            and all(len(r) >= 13 for r in rows.values())  # past a commit, mid-interval
        ),
        90,
        "three workers past step 13",
    )
    before = rows_by_pid(job.steps_dir)
    victim_pid = next(pid for pid, rows in before.items() if rows[-1]["rank"] == 2)
    victim = next(a for a in agents if a.pid == parent(victim_pid))
    with EtcdClient(job.endpoints) as c:
        seen = status.read(c, RunKeys("/etcdrun", job.run_id))
    node = next(p.node_id for p in seen.participants if p.pid == victim.pid)
    cmd = [etcdrun_bin(), "drain", node, "--rdzv-endpoint", job.endpoints]
    asked = subprocess.run(
        [*cmd, "--rdzv-id", job.run_id], capture_output=True, text=True, env=clean_env()
    )
    assert asked.returncode == 0, asked.stderr
    for a in agents:
        assert a.wait(120) == 0, a.stderr[-3000:]
    after = rows_by_pid(job.steps_dir)
    left = [r["step"] for r in after[victim_pid]]
    assert left[-1] % 10 == 0, f"the drained worker stopped at step {left[-1]}, not a commit"
    for pid in before:
        if pid != victim_pid:  # every step once: nothing redone, nothing skipped
            done = [r["step"] for r in after[pid]]
            assert done == list(range(1, steps + 1)), f"pid {pid}: steps {done}"
            assert {r["round"] for r in after[pid]} == {1, 2}
    assert not events(job.logs, "workers_restarted"), "a survivor was restarted"
    assert "drain: stopping after the workers' commit" in victim.stderr, victim.stderr[-3000:]
