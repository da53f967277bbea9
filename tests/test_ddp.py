"""A real client: an unmodified PyTorch DDP script (gloo, CPU) under etcdrun on a real etcd.

torch is a test extra (pyproject ``test``), never a runtime dependency: the agent never imports
it. Missing torch skips here locally, but FAILS in CI, where a skip would hide it.
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
from agent_helpers import SCRIPTS, Job, clean_env

DDP_SCRIPT = str(SCRIPTS / "ddp_train.py")


@pytest.fixture
def torch_available() -> None:
    if importlib.util.find_spec("torch") is None:
        msg = "torch is not installed (pip install -e '.[test]' brings torch==2.13.0)"
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail(f"{msg} [CI=true: a missing torch is an error]", pytrace=False)
        pytest.skip(msg)


def test_unmodified_ddp_script_on_two_agents_two_workers(etcd, tmp_path, torch_available):
    job = Job(etcd.endpoints, tmp_path, nnodes="2", conf="lease_ttl=2,join_timeout=60",
              script=(DDP_SCRIPT,))
    try:
        agents = [job.start(env=clean_env()) for _ in range(2)]
        codes = [a.wait(120) for a in agents]
        assert codes == [0, 0], "\n".join(f"{a.name}:\n{a.stderr[-3000:]}" for a in agents)
        out = "".join(a.stdout for a in agents)
        lines = re.findall(r"^\[(\d+)\]:rank (\d+)/(\d+) all_reduce (\S+) params (\S+)$", out,
                           re.MULTILINE)
        assert sorted((int(p), int(r)) for p, r, *_ in lines) == [(r, r) for r in range(4)], out
        assert {w for _, _, w, _, _ in lines} == {"4"}
        assert {s for _, _, _, s, _ in lines} == {"10"}  # 1 + 2 + 3 + 4, across both nodes
        assert len({c for *_, c in lines}) == 1, out  # DDP kept the four replicas identical
        losses = re.findall(r"^\[(\d+)\]:final loss (\d+\.\d+)$", out, re.MULTILINE)
        assert len(losses) == 1 and losses[0][0] == "0", out
    finally:
        job.close()
