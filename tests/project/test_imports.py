"""Who may import whom, read from the source (every import, at module level or inside a function).

The etcd backend (rendezvous/etcd/) is built in layers, each importing only those under it:
core/ (the run's keys, values, pure decision, fenced transactions, the Session), node/ (what
every agent does for itself), leader/ (what the oldest agent does for all), ports/ (what the
agent holds of the backend), and the handler on top. It imports nothing of the launcher that
uses it (agent/), the torchrun plugin (torch/), the tools that read a run (tools/), the other
backend (static/) or the etcd processes for tests (localetcd/). Why: a layer can then be read,
tested and changed knowing everything it depends on is beneath it.

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


ETCD = ROOT / "rendezvous" / "etcd"
LAYERS = ("core", "node", "leader", "ports", "")  # bottom first; "" is etcd/ itself: the handler
NOT_FROM_ETCD = (
    "etcdrun.agent",
    "etcdrun.elastic",
    "etcdrun.rendezvous.torch",
    "etcdrun.rendezvous.tools",
    "etcdrun.rendezvous.static",
    "etcdrun.rendezvous.localetcd",
)


def etcd_layer(path_or_module: Path | str) -> int:
    """The layer of a file under rendezvous/etcd/, or of a module of etcdrun.rendezvous.etcd."""
    if isinstance(path_or_module, Path):
        parts = path_or_module.relative_to(ETCD).parts
        folder = parts[0] if len(parts) > 1 else ""
    else:
        rest = path_or_module.removeprefix("etcdrun.rendezvous.etcd").lstrip(".").split(".")
        folder = rest[0] if rest[0] in LAYERS[:-1] else ""
    return LAYERS.index(folder)


def upward(path: Path) -> set[str]:
    """The imports of ``path`` (under rendezvous/etcd/) that reach a layer above its own, or
    outside what the etcd backend may use.
    """
    mine = etcd_layer(path)
    bad = set()
    for m in imports(path):
        if m.startswith(NOT_FROM_ETCD):
            bad.add(m)
        elif m.startswith("etcdrun.rendezvous.etcd.") and etcd_layer(m) > mine:
            bad.add(m)
    return bad


def test_the_etcd_backend_imports_only_down_its_layers():
    files = sorted(ETCD.rglob("*.py"))
    seen = {etcd_layer(p) for p in files}
    assert seen == set(range(len(LAYERS))), f"a layer has no module: {sorted(seen)}"
    found = {f"{p.relative_to(ROOT)}: {m}" for p in files for m in upward(p)}
    assert not found, f"imports up the etcd backend's layers: {sorted(found)}"


def test_the_layer_check_can_fail(tmp_path):
    probe = ETCD / "core" / "probe.py"  # only parsed: never written
    assert etcd_layer(probe) == 0 and etcd_layer(ETCD / "handler.py") == 4
    assert etcd_layer("etcdrun.rendezvous.etcd.leader.term") == 2
    assert etcd_layer("etcdrun.rendezvous.etcd.handler") == 4
    text = (
        "from etcdrun.rendezvous.etcd.leader import term\nfrom etcdrun.rendezvous.torch import x\n"
    )
    fake = tmp_path / "probe.py"
    fake.write_text(text)
    got = {m for m in imports(fake) if m.startswith("etcdrun.rendezvous.etcd.")}
    assert got and all(etcd_layer(m) > 0 for m in got)
    assert any(m.startswith(NOT_FROM_ETCD) for m in imports(fake))


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
