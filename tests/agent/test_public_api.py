"""The public names and entry points: ``from etcdrun import ...``, ``python -m etcdrun``.

Why a subprocess for the import cost: sys.modules of the test process already holds everything;
a fresh interpreter shows what ``import etcdrun`` really loads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import etcdrun
import etcdrun.agent
from etcdrun.agent import config, errors, launcher

PY = sys.executable
NAMES = ["ChildFailedError", "LaunchConfig", "elastic_launch", "launch_agent", "record"]
HEAVY = ("grpc", "google.protobuf", "tenacity", "torch")


def test_the_reference_names_from_both_places():
    defined = {
        "ChildFailedError": errors.ChildFailedError,
        "LaunchConfig": config.LaunchConfig,
        "elastic_launch": launcher.elastic_launch,
        "launch_agent": launcher.launch_agent,
        "record": errors.record,
    }
    for name in NAMES:
        assert getattr(etcdrun, name) is getattr(etcdrun.agent, name) is defined[name], name
    assert sorted(etcdrun.agent.__all__) == sorted(etcdrun.agent.EXPORTS) == NAMES
    assert set(NAMES) <= set(etcdrun.__all__) and set(NAMES) <= set(dir(etcdrun))
    from etcdrun.rendezvous._version import __version__

    assert etcdrun.__version__ == __version__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        etcdrun.nope  # noqa: B018
    with pytest.raises(AttributeError):
        etcdrun.agent.nope  # noqa: B018


def _loaded(code: str) -> list[str]:
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_import_etcdrun_is_cheap():
    mods = _loaded("import etcdrun, etcdrun.agent")
    assert [m for m in mods if m.startswith("etcdrun")] == ["etcdrun", "etcdrun.agent"]
    assert not [m for m in mods if m.startswith(HEAVY)]


def test_the_public_names_load_no_grpc():
    mods = _loaded("from etcdrun import " + ", ".join(NAMES))
    assert "etcdrun.agent.launcher" in mods
    assert not [m for m in mods if m.startswith(HEAVY)]
    assert not [m for m in mods if m.startswith(("etcdrun.rendezvous.etcd", "etcdrun.proto"))]


def test_the_agent_without_etcd_loads_no_grpc():
    """A static (or --standalone) agent, its observer and its health port: no gRPC, and no
    prometheus-client unless the prometheus handler is on.
    """
    mods = _loaded(
        "import etcdrun.agent.elastic_agent, etcdrun.agent.report.observer, "
        "etcdrun.agent.report.health, "
        "etcdrun.rendezvous.static.handler"
    )
    assert not [m for m in mods if m.startswith(HEAVY)]
    assert not [m for m in mods if m.startswith(("etcdrun.proto", "prometheus_client"))]


@pytest.mark.parametrize("module", ["etcdrun", "etcdrun.agent.cli"])
def test_python_dash_m_is_the_cli(module):
    helped = subprocess.run([PY, "-m", module, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and helped.stderr == ""
    assert helped.stdout.startswith("usage: etcdrun ") and "--rdzv-endpoint" in helped.stdout
    bad = subprocess.run(
        [PY, "-m", module, "--nnodes", "3:2", "t.py"], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert bad.stderr == "etcdrun: error: max_nodes (2) must be >= min_nodes (3)\n"


def test_python_dash_m_etcdrun_runs_a_job(tmp_path):
    out = tmp_path / "ran"
    job = ["--standalone", "--nproc-per-node", "2", "--no-python", "sh", "-c"]
    script = f'echo "$RANK/$WORLD_SIZE" >> {out}'
    proc = subprocess.run(
        [PY, "-m", "etcdrun", *job, script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(out.read_text().split()) == ["0/2", "1/2"]
