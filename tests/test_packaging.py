"""One import root: the wheel holds etcdrun/agent, etcdrun/rendezvous, etcdrun/proto and nothing
at the top level; `import agent` does not work once installed; the console script answers."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_has_one_import_root(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    wheel = next(tmp_path.glob("etcdrun-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    code = [n for n in names if not n.startswith("etcdrun-") or ".dist-info/" not in n]
    assert code and all(n.startswith("etcdrun/") for n in code), code[:20]
    for needed in (
        "etcdrun/agent/cli.py",
        "etcdrun/rendezvous/client/client.py",
        "etcdrun/proto/etcd_api_pb2.py",
        "etcdrun/proto/etcd_api.proto",
    ):
        assert needed in names
    assert not any(n.startswith(("tests/", "bench/", "agent/", "examples/")) for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "etcdrun = etcdrun.agent.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


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
