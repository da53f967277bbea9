"""A torchrun user switches by changing one word: torchrun's documented command lines (the usage
section of torch/distributed/run.py, torch 2.13) run under etcdrun unchanged apart from the
backend word, and the workers get the environment torchrun gives them for the same command.

Each case runs the command under torchrun and under etcdrun on this machine (the etcd ones
against the etcd fixture; torchrun's against its own c10d store), with a worker that writes its
environment to a file, and compares what each launcher added to the environment it was given.
The intended differences, and why:

- ``MASTER_ADDR``/``MASTER_PORT``: the same for every worker of a job under both, but other
  values: torchrun's c10d names its agent's store host and a port it picked; etcdrun names the
  rank-0 node's address and a port it reserved (``--master-port`` under static, as torchrun).
- ``TORCHELASTIC_USE_AGENT_STORE``: torchrun's agent hosts a TCPStore the workers join (True);
  etcdrun's agent has none (its rendezvous is etcd, or static/barrier.py), so worker rank 0
  hosts the workers' store on MASTER_PORT (False): ``init_process_group`` works either way.
- ``TORCHELASTIC_ERROR_FILE``: set under both, in each launcher's own log folder.
- ``TORCHELASTIC_RUN_ID``: the ``--rdzv-id`` under both; with ``--standalone`` a fresh uuid4
  under both (not the same one).
- ``ETCDRUN_ROUND``: etcdrun's own (the round the worker runs in).
- ``ETCDRUN_PROGRESS_FILE``: etcdrun's own, under the etcd backend (the page that
  ``etcdrun.elastic.progress`` writes, for the straggler report: design.md §4d).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import etcdrun_bin, suite_prewarm, torchrun_bin
from layout import ROOT

from etcdrun.agent.options import ETCDRUN_ONLY, build_parser
from etcdrun.rendezvous.free_port import reserve_free_port

ENVDUMP = """
import json, os, sys
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(dict(os.environ), f)
"""
# Set by both launchers, compared value for value (per worker, by RANK).
SAME = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)
DIFFERENT = {  # set by both, other values (see the module docstring)
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_RUN_ID",
}
# the round; the warden's tag (agent/fencing/warden.py)
# The in-place channel's name and how long a worker awaits its verdict (docs/in-place.md) too.
OURS_ONLY = {"ETCDRUN_ROUND", "ETCDRUN_NODE_TAG", "ETCDRUN_CONTROL", "ETCDRUN_PEER_WAIT"}
OURS_ONLY |= {"ETCDRUN_PROGRESS_FILE"}  # the etcd backend's: the page progress() writes


def base_env() -> dict[str, str]:
    drop = ("PET_", "TORCHELASTIC_", "TORCH_ELASTIC", "OMP_NUM_THREADS", "PYTHON_EXEC", "LOGLEVEL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PET_PREWARM"] = suite_prewarm()  # etcdrun's; torchrun has no such flag, ignores it
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(launcher: str, nodes: list[list[str]], out: Path, script: Path) -> list[dict[str, str]]:
    """Run one job: one ``launcher`` process per node (its flags in ``nodes``), all at once."""
    out.mkdir(parents=True)
    exe = etcdrun_bin() if launcher == "etcdrun" else torchrun_bin()
    procs = []
    for i, flags in enumerate(nodes):
        log = open(out / f"node{i}.log", "w")  # noqa: SIM115 - closed right after the start
        argv = [exe, *flags, str(script), str(out)]
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=base_env()))
        log.close()
    try:
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "".join((out / f"node{i}.log").read_text() for i in range(len(nodes)))
    assert codes == [0] * len(nodes), f"{launcher}: exit codes {codes}\n{logs[-4000:]}"
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def added(env: dict[str, str]) -> dict[str, str]:
    base = base_env()
    return {k: v for k, v in env.items() if base.get(k) != v}


def compare(torchrun: list[dict[str, str]], ours: list[dict[str, str]], run_id: str | None) -> None:
    assert len(torchrun) == len(ours) > 0
    theirs = {k for e in torchrun for k in added(e)}
    mine = {k for e in ours for k in added(e)}
    assert mine - OURS_ONLY == theirs, (sorted(mine - theirs), sorted(theirs - mine))
    assert set(SAME) | DIFFERENT <= theirs | {"OMP_NUM_THREADS"}
    by_rank = {int(e["RANK"]): e for e in torchrun}
    for e in ours:
        t = by_rank[int(e["RANK"])]
        assert {k: e.get(k) for k in SAME} == {k: t.get(k) for k in SAME}, e["RANK"]
    for job in (torchrun, ours):
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in job}) == 1
        assert {e["TORCHELASTIC_USE_AGENT_STORE"] for e in job} <= {"True", "False"}
        assert all(e["TORCHELASTIC_ERROR_FILE"].endswith("error.json") for e in job)
        ids = {e["TORCHELASTIC_RUN_ID"] for e in job}
        if run_id is None:  # --standalone: a fresh uuid4
            assert len(ids) == 1 and uuid.UUID(ids.pop()).version == 4
        else:
            assert ids == {run_id}
    assert {e["TORCHELASTIC_USE_AGENT_STORE"] for e in ours} == {"False"}
    assert {e["ETCDRUN_ROUND"] for e in ours} == {str(min(int(e["ETCDRUN_ROUND"]) for e in ours))}


@pytest.fixture
def job(tmp_path, torch_available):
    script = tmp_path / "envdump.py"
    script.write_text(ENVDUMP)

    def both(torchrun: list[list[str]], ours: list[list[str]], run_id: str | None) -> None:
        theirs = launch("torchrun", torchrun, tmp_path / "torchrun", script)
        mine = launch("etcdrun", ours, tmp_path / "etcdrun", script)
        compare(theirs, mine, run_id)

    return both


def swap(flags: list[str], old: str, new: str) -> list[str]:
    """The command line with one word changed: the backend's (and, for etcd, its endpoint)."""
    return [new if f == old else f for f in flags]


def test_single_node_multi_worker_standalone(job):
    # torchrun --standalone --nnodes=1 --nproc-per-node=$NUM_TRAINERS YOUR_TRAINING_SCRIPT.py
    flags = ["--standalone", "--nnodes=1", "--nproc-per-node=2"]
    job([flags], [flags], None)


def test_stacked_single_node_free_port(job):
    # torchrun --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --nnodes=1 --nproc-per-node=N
    # (a free port, picked by the launcher): etcdrun's static backend does it, with no server.
    flags = ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "--nnodes=1"]
    flags += ["--nproc-per-node=2"]
    job([flags], [swap(flags, "--rdzv-backend=c10d", "--rdzv-backend=static")], "none")


def test_fault_tolerant_fixed_nodes(job, etcd):
    # torchrun --nnodes=$NUM_NODES --nproc-per-node=$NUM_TRAINERS --max-restarts=3
    #   --rdzv-id=$JOB_ID --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR
    run_id = "ft-" + uuid.uuid4().hex[:8]
    host = f"--rdzv-endpoint=127.0.0.1:{reserve_free_port()}"
    flags = ["--nnodes=2", "--nproc-per-node=2", "--max-restarts=3", f"--rdzv-id={run_id}"]
    flags += ["--rdzv-backend=c10d", host]
    ours = swap(
        swap(flags, "--rdzv-backend=c10d", "--rdzv-backend=etcd"),
        host,
        f"--rdzv-endpoint={etcd.endpoints}",
    )
    job([flags] * 2, [ours] * 2, run_id)


def test_elastic_min_max(job, etcd):
    # torchrun --nnodes=1:4 --nproc-per-node=$NUM_TRAINERS --max-restarts=3 --rdzv-id=$JOB_ID
    #   --rdzv-backend=c10d --rdzv-endpoint=$HOST_NODE_ADDR  (four nodes: the round is full at
    #   once; fewer wait last_call_timeout, 30 s, under both launchers)
    run_id = "el-" + uuid.uuid4().hex[:8]
    host = f"--rdzv-endpoint=127.0.0.1:{reserve_free_port()}"
    flags = ["--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=3", f"--rdzv-id={run_id}"]
    flags += ["--rdzv-backend=c10d", host]
    ours = swap(
        swap(flags, "--rdzv-backend=c10d", "--rdzv-backend=etcd"),
        host,
        f"--rdzv-endpoint={etcd.endpoints}",
    )
    job([flags] * 4, [ours] * 4, run_id)


def test_static_multi_node_unchanged(job):
    # The static multi-node form (torch.distributed.launch's): the same words for both.
    def node(rank: int, port: int) -> list[str]:
        return [
            "--nnodes=2",
            f"--node-rank={rank}",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
        ]

    p1, p2 = reserve_free_port(), reserve_free_port()
    job([node(0, p1), node(1, p1)], [node(0, p2), node(1, p2)], "none")


# ---- every torchrun flag ---------------------------------------------------------------------
def torch_options() -> dict[str, Any]:
    """torchrun's options (torch's own parser), by their dash spelling."""
    from torch.distributed.run import get_args_parser

    out = {}
    for action in get_args_parser()._actions:
        if action.option_strings:
            out[max((o for o in action.option_strings if "_" not in o), key=len)] = action
    return out


def test_every_torchrun_option_is_ours_and_ours_are_torchruns_plus_few(torch_available):
    from torch.distributed.run import get_args_parser

    theirs = set(get_args_parser()._option_string_actions)
    ours = set(build_parser()._option_string_actions)
    assert theirs <= ours, sorted(theirs - ours)
    assert ours - theirs == ETCDRUN_ONLY


STATUSES = ("supported", "accepted with a notice", "not applicable")
ROW = re.compile(r"^\| `(--?[\w-]+)`(?: / `[^`]+`)* \| ([a-z ]+) \|(.*)\|$")


def documented_flags() -> dict[str, tuple[str, str]]:
    """The flag table of docs/torchrun.md, between its torchrun-flags markers."""
    text = (ROOT / "docs" / "torchrun.md").read_text()
    section = text.split("<!-- torchrun-flags -->")[1].split("<!-- /torchrun-flags -->")[0]
    rows = [ROW.match(line) for line in section.splitlines() if line.startswith("| `")]
    assert all(rows), [line for line in section.splitlines() if line.startswith("| `")]
    return {m[1]: (m[2], m[3]) for m in rows if m}


def test_docs_list_every_torchrun_flag_with_its_status(torch_available):
    """docs/torchrun.md's flag table names exactly the installed torchrun's options (2.14 in
    CI): it cannot drift.
    """
    listed = documented_flags()
    assert set(listed) == set(torch_options()), (
        sorted(set(torch_options()) - set(listed)),
        sorted(set(listed) - set(torch_options())),
    )
    assert {status for status, _ in listed.values()} <= set(STATUSES)


def fake_logs_specs(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed ``torchrun.logs_specs`` entry point named ``mine`` (a dist-info on sys.path)."""
    dist = root / "mylogs-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mylogs\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[torchrun.logs_specs]\nmine = mylogs:Specs\n")
    monkeypatch.syspath_prepend(str(root))


def test_flags_accepted_with_a_notice_say_so_at_start(tmp_path, monkeypatch):
    """Each "accepted with a notice" row: the flag parses and its notice line names it."""
    from etcdrun.agent import accelerators, cli

    monkeypatch.setattr(accelerators, "ROOT", str(tmp_path))  # a node without GPUs
    fake_logs_specs(tmp_path, monkeypatch)
    values = {"--numa-binding": "node", "--event-log-handler": "console", "--logs-specs": "mine"}
    for flag, (status, _) in documented_flags().items():
        if status != "accepted with a notice":
            continue
        assert flag in values, f"{flag}: give the test a value that needs a notice"
        config, _, _ = cli.parse_args([flag, values[flag], "t.py"])
        assert any(n.startswith(flag) for n in config.notices()), (flag, config.notices())


def test_logs_specs_found_as_an_entry_point_is_accepted_with_a_notice(tmp_path, monkeypatch):
    fake_logs_specs(tmp_path, monkeypatch)
    from etcdrun.agent import cli

    config, _, _ = cli.parse_args(["--logs-specs", "mine", "t.py"])
    assert config.logs_specs == "mine"
    assert config.notices()[0].startswith("--logs-specs mine: not honoured")
