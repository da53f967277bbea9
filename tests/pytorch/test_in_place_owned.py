"""In place as a real job needs it (design.md §4a): a DDP job on ``etcdrun.elastic`` with a
OneCycleLR schedule, an ``ElasticSampler`` and a TCP connection of its own, through a kill -9 of
a node and then a newcomer, on real agents, a real etcd and gloo.

Why each check:
- no numpy: torch does not bring it, and every worker of such a job died at its first sync when
  the state was decoded with ``Tensor.numpy()``. The job runs with ``import numpy`` failing.
- the script's own connection: a release shut every connected socket of the process, a
  tracker's or a database's too. The worker connects to an echo server here before it forms its
  group and uses that connection at the first step of every round.
- the learning rate: a scheduler deep-copied away from its optimizer gave the newcomer a fresh
  schedule's rate while the survivors were far along theirs, and the replicas parted silently.
  Every rank's rate at every step must be the one a run with no failure has at that step.
- the sampler: each step, the ranks together must consume the next stretch of the epoch's
  order, whatever the world size: nothing skipped, nothing seen twice but the step in flight.
"""

from __future__ import annotations

import os
import signal
import socketserver
import threading

import pytest
from agent_helpers import SCRIPTS, Job, clean_env, parent, rows_by_pid, wait_for

SCRIPT = str(SCRIPTS / "elastic_owned.py")
NO_NUMPY = str(SCRIPTS / "no_numpy")
STEPS, BATCH, LENGTH = 80, 4, 4096


class _Echo(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        for line in self.rfile:
            self.wfile.write(line)


@pytest.fixture
def echo():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="echo", daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def reference_lrs(steps: int) -> list[float]:
    """The rate of every step of a run with no failure."""
    import torch

    opt = torch.optim.SGD(torch.nn.Linear(4, 1).parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def epoch_order() -> list[int]:
    import torch

    g = torch.Generator()
    g.manual_seed(7)
    return torch.randperm(LENGTH, generator=g).tolist()


@pytest.mark.parametrize("init", ["elastic", "dist"])
def test_a_kill_and_a_newcomer_keep_the_schedule_the_data_and_the_scripts_socket(
    etcd, tmp_path, torch_available, echo, init
):
    out = tmp_path / "out"
    out.mkdir()
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="2:4",
        nproc=1,
        conf="lease_ttl=2,last_call_timeout=1",
        extra=("--prewarm", "none", "--log-dir", str(tmp_path / "logs")),
        script=(SCRIPT, str(out), str(STEPS), "0.1"),
    )
    env = clean_env(ECHO=echo, INIT=init, PYTHONPATH=NO_NUMPY)
    try:
        agents = [job.start(env=env) for _ in range(3)]
        wait_for(
            lambda: len(r := rows_by_pid(out)) == 3 and all(len(x) >= 8 for x in r.values()),
            90,
            "three workers past step 8",
        )
        before = rows_by_pid(out)
        victim_pid = next(pid for pid, rows in before.items() if rows[-1]["rank"] == 2)
        victim = next(a for a in agents if a.pid == parent(victim_pid))
        os.kill(victim_pid, signal.SIGKILL)
        victim.proc.kill()
        wait_for(
            lambda: all(
                rows[-1]["world"] == 2
                for pid, rows in rows_by_pid(out).items()
                if pid != victim_pid
            ),
            60,
            "the survivors training with world size 2",
        )
        agents.append(job.start(env=env))
        for a in agents:
            if a is not victim:
                assert a.wait(180) == 0, a.stderr[-3000:]
    finally:
        job.close()

    after = rows_by_pid(out)
    kept = [pid for pid in before if pid != victim_pid]
    newcomer = (set(after) - set(before)).pop()
    lrs = reference_lrs(STEPS)
    for pid in [*kept, newcomer]:
        rows = after[pid]
        assert not any(r["numpy"] for r in rows), "numpy was importable: the test tests nothing"
        for r in rows:
            assert r["lr"] == pytest.approx(lrs[r["step"] - 1], rel=1e-9), (pid, r)
        assert all(r["echo"] for r in rows if "echo" in r), f"pid {pid}: its own socket broke"
    for pid in kept:
        steps = [r["step"] for r in after[pid]]
        assert steps[-1] == STEPS and sorted(set(steps)) == list(range(1, STEPS + 1)), steps
        assert [r["round"] for r in after[pid] if "echo" in r] == [1, 2, 3], (
            "a survivor used its own connection in each of its three rounds"
        )
    # The samples: each step is logged in one round only (a step cut short is never logged; one
    # that one rank committed is the state every rank syncs to), and rank r of a world of W took
    # the first BATCH of the rest of the epoch's order dealt by stride: rest[r::W].
    order, done = epoch_order(), {}
    for rows in after.values():
        for r in rows:
            done.setdefault(r["step"], []).append(r)
    consumed = 0
    for step in range(1, STEPS + 1):
        rows = done[step]
        assert len({r["round"] for r in rows}) == 1, f"step {step} logged in two rounds"
        (world,) = {r["world"] for r in rows}
        rest = order[consumed:]
        for r in rows:
            assert r["samples"] == rest[r["rank"] :: world][:BATCH], (step, r)
        consumed += BATCH * world
