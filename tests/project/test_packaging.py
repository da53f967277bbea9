"""One import root: the wheel holds etcdrun/ (its __init__ and __main__), etcdrun/agent,
etcdrun/rendezvous, etcdrun/proto and nothing at the top level; `import agent` does not work once
installed; the console script and `python -m etcdrun` answer, from the wheel alone.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from layout import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the sources: an in-tree build reuses build/lib, where a module
    renamed since (agent/logs.py) would still sit and end up in the wheel.
    """
    src = tmp_path_factory.mktemp("src") / "etcdrun"
    junk = (
        "build",
        "dist",
        "*.egg-info",
        ".git",
        "__pycache__",
        ".venv*",
        "out",
        ".*_cache",
        ".cache",
    )
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*junk))
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return next(out.glob("etcdrun-*.whl"))


def test_wheel_has_one_import_root(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if not n.startswith("etcdrun-") or ".dist-info/" not in n]
    assert code and all(n.startswith("etcdrun/") for n in code), code[:20]
    for needed in (
        "etcdrun/__init__.py",
        "etcdrun/__main__.py",
        "etcdrun/agent/__init__.py",
        "etcdrun/agent/cli.py",
        "etcdrun/rendezvous/client/client.py",
        "etcdrun/proto/etcd_api_pb2.py",
        "etcdrun/proto/etcd_api.proto",
    ):
        assert needed in names
    assert not any(n.startswith(("tests/", "bench/", "agent/", "examples/")) for n in names)
    assert not any("_root" in n for n in names), "agent/_root is the package etcdrun, not a copy"
    assert not any(n.startswith("etcdrun/agent/elastic/") for n in names), "one etcdrun.elastic"
    # Exactly the repository's modules, in every folder: nothing stale, nothing left out (a new
    # subpackage must be listed in pyproject.toml, or the wheel and every image lack it).
    ours = set()
    for folder in ("agent", "rendezvous"):
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder)
            if rel.parts[0] == "_root":  # the package etcdrun itself
                ours.add("etcdrun/" + "/".join(rel.parts[1:]))
            elif folder == "agent" and rel.parts[0] == "elastic":  # etcdrun.elastic
                ours.add("etcdrun/" + "/".join(rel.parts))
            else:
                ours.add(f"etcdrun/{folder}/" + "/".join(rel.parts))
    packed = {n for n in names if n.endswith(".py") and n.startswith("etcdrun/")}
    packed -= {n for n in packed if n.startswith("etcdrun/proto/")}
    assert packed == ours, sorted(packed ^ ours)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "etcdrun = etcdrun.agent.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_python_dash_m_etcdrun_from_the_wheel_alone(wheel, tmp_path):
    """Unpacked on its own (no site-packages, so not the editable install): the package
    ``etcdrun`` is the wheel's, and ``python -m etcdrun`` answers.
    """
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-S", *args], cwd=tmp_path, env=env, capture_output=True, text=True
        )

    where = run("-c", "import etcdrun, etcdrun.agent.cli as c; print(etcdrun.__file__, c.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(site)) for p in where.stdout.split()), where.stdout
    version = run("-m", "etcdrun", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("etcdrun ")
    helped = run("-m", "etcdrun", "--help")
    assert helped.returncode == 0 and "--rdzv-endpoint" in helped.stdout, helped.stderr


def test_no_generic_top_level_names(tmp_path):
    """From outside the repository only ``etcdrun`` is importable."""
    code = (
        "import importlib.util as u, etcdrun.agent, etcdrun.rendezvous, etcdrun.proto;"
        "print([n for n in ('agent', 'rendezvous', 'proto') if u.find_spec(n)])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_console_script_version_and_help():
    v = subprocess.run(["etcdrun", "--version"], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and v.stdout.startswith("etcdrun ")
    h = subprocess.run(["etcdrun", "--help"], capture_output=True, text=True, timeout=60)
    assert h.returncode == 0 and "--rdzv-endpoint" in h.stdout
