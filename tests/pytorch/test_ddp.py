"""A real client: an unmodified PyTorch DDP script (gloo, CPU) under etcdrun on a real etcd.

torch is a test extra (pyproject ``test``), never a runtime dependency: the agent never imports
it. Missing torch skips here locally, but FAILS in CI, where a skip would hide it.
"""

from __future__ import annotations

import re

from agent_helpers import SCRIPTS, Job, clean_env, wait_for

DDP_SCRIPT = str(SCRIPTS / "ddp_train.py")


def test_unmodified_ddp_script_on_two_agents_two_workers(etcd, tmp_path, torch_available):
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="2",
        conf="lease_ttl=2,join_timeout=60",
        script=(DDP_SCRIPT,),
    )
    try:
        agents = [job.start(env=clean_env()) for _ in range(2)]
        codes = [a.wait(120) for a in agents]
        assert codes == [0, 0], "\n".join(f"{a.name}:\n{a.stderr[-3000:]}" for a in agents)
        out = "".join(a.stdout for a in agents)
        lines = re.findall(
            r"^\[(\d+)\]:rank (\d+)/(\d+) all_reduce (\S+) params (\S+)$", out, re.MULTILINE
        )
        assert sorted((int(p), int(r)) for p, r, *_ in lines) == [(r, r) for r in range(4)], out
        assert {w for _, _, w, _, _ in lines} == {"4"}
        assert {s for _, _, _, s, _ in lines} == {"10"}  # 1 + 2 + 3 + 4, across both nodes
        assert len({c for *_, c in lines}) == 1, out  # DDP kept the four replicas identical
        losses = re.findall(r"^\[(\d+)\]:final loss (\d+\.\d+)$", out, re.MULTILINE)
        assert len(losses) == 1 and losses[0][0] == "0", out
    finally:
        job.close()


def test_peer_death_that_breaks_collectives_costs_no_restart(etcd, tmp_path, torch_available):
    """kill -9 of one of three agents: the survivors' all_reduce fails before the dead node's
    lease expires, yet with --max-restarts 0 the job carries on with WORLD_SIZE 2 — a death is a
    membership change, not a worker failure (torchrun's job dies here).
    """
    job = Job(
        etcd.endpoints,
        tmp_path,
        nnodes="2:3",
        nproc=1,
        conf="lease_ttl=2,last_call_timeout=1,join_timeout=60",
        extra=("--max-restarts", "0"),
        script=(str(SCRIPTS / "allreduce_loop.py"), "25"),
    )
    try:
        agents = [job.start(env=clean_env()) for _ in range(3)]
        wait_for(
            lambda: sum("running rank" in a.stdout for a in agents) == 3,
            60,
            "three workers running",
        )
        victim = next(a for a in agents if re.search(r"running rank 2/3", a.stdout))
        victim.proc.kill()
        rest = [a for a in agents if a is not victim]
        codes = [a.wait(90) for a in rest]
        assert codes == [0, 0], "\n".join(a.stderr[-3000:] for a in rest)
        out = "".join(a.stdout for a in rest)
        assert re.search(r"running rank 0/2 round \d+ restarts 0", out), out
        assert re.search(r"running rank 1/2 round \d+ restarts 0", out), out
        assert out.count("done rank") == 2
    finally:
        job.close()
