"""Who may import whom, read from the source (every import, at module level or inside a function).

etcdrun.elastic (agent/elastic/) runs inside the user's training script. It reaches the agent
only through the worker-side modules that run in the worker process anyway, each of them
standard library only: the control channel's protocol, the progress page's format, and the
standby bootstrap's store dial. Why: whatever else it imported would load agent internals (and
gRPC, protobuf) into every training process, and would tie the script's API to how the agent is
built this month.
"""

from __future__ import annotations

import ast
from pathlib import Path

from layout import ROOT

ELASTIC = ROOT / "agent" / "elastic"
# What etcdrun.elastic may import of the rest of etcdrun: the declared worker-side modules.
WORKER_SIDE = {
    "etcdrun.agent.worker.control",  # the channel to the agent: messages, connect, encode
    "etcdrun.agent.worker.beat",  # the progress page the agent reads
    "etcdrun.agent.standby.boot",  # await_listener: how a worker dials a round's store
}


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, by absolute name: ``from x import y`` gives ``x.y`` where
    that is a module of agent/ (``from etcdrun.agent.worker import beat``), else ``x``.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                agent_module = sub.startswith("etcdrun.agent.") and module_path(sub).is_file()
                found.add(sub if agent_module else node.module)
    return found


def module_path(name: str) -> Path:
    """The source file of an etcdrun.agent module (pyproject maps etcdrun.agent onto agent/)."""
    return ROOT.joinpath("agent", *name.split(".")[2:]).with_suffix(".py")


def outside_elastic(path: Path) -> set[str]:
    return {m for m in imports(path) if m.startswith("etcdrun") and not _elastic(m)}


def _elastic(name: str) -> bool:
    return name == "etcdrun.elastic" or name.startswith("etcdrun.elastic.")


def test_etcdrun_elastic_reaches_the_agent_only_through_the_worker_side_modules():
    files = sorted(ELASTIC.glob("*.py"))
    assert len(files) > 10, f"etcdrun.elastic is not at {ELASTIC}"
    used = {f"{p.relative_to(ROOT)}: {m}" for p in files for m in outside_elastic(p)}
    undeclared = sorted(u for u in used if u.split(": ")[1] not in WORKER_SIDE)
    assert not undeclared, f"etcdrun.elastic imports agent internals: {undeclared}"
    assert used, "the check found no import of the worker-side modules at all"


def test_the_worker_side_modules_import_nothing_of_etcdrun():
    """Else the boundary leaks: importing one would load whatever it imports."""
    for name in sorted(WORKER_SIDE):
        path = module_path(name)
        assert path.is_file(), f"{name}: no {path}"
        assert not {m for m in imports(path) if m.startswith("etcdrun")}, name


def test_the_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\nfrom etcdrun.elastic import state\n"
        "def f():\n    from etcdrun.agent.loop import AgentLoop\n"
    )
    assert outside_elastic(probe) == {"etcdrun.agent.loop"}
