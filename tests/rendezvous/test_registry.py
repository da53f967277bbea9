"""What the registry says about each backend, and that the CLI and launcher ask it.

Why: the command line and the launcher used to branch on ``"static"`` and ``("etcd",
"etcd-v3")``. Here a plugin backend with the static backend's traits (an endpoint that is the
master node, a node rank) gets the same treatment from both, and no agent module types a
backend name.
"""

from __future__ import annotations

import ast

import pytest
from layout import ROOT

from etcdrun.agent.cli import UsageError, parse_args
from etcdrun.agent.config import LaunchConfig
from etcdrun.agent.launcher import _make_rdzv_handler
from etcdrun.rendezvous import registry
from etcdrun.rendezvous.registry import Backend, register_backend
from etcdrun.rendezvous.static.handler import StaticRendezvousHandler

AGENT = ROOT / "agent"


@pytest.fixture
def scratch_backends():
    before = dict(registry._backends)
    yield
    registry._backends.clear()
    registry._backends.update(before)


def test_describe_lists_aliases_with_their_backend():
    assert registry.describe_backends() == "static, etcd (alias etcd-v3)"
    names = [name for name, _, _ in registry.backend_groups()]
    assert names == ["static", "etcd"]


def test_read_endpoint_normalises_etcd_and_finds_the_static_master():
    etcd = registry.read_endpoint("etcd-v3", "e1, https://e2:2380")
    assert (etcd.endpoint, etcd.master_addr, etcd.master_port) == (
        "e1:2379,https://e2:2380",
        None,
        None,
    )
    static = registry.read_endpoint("static", "[::1]:5")
    assert (static.endpoint, static.master_addr, static.master_port) == ("[::1]:5", "::1", 5)
    with pytest.raises(ValueError, match="malformed etcd endpoint"):
        registry.read_endpoint("etcd", "ftp://h")


def test_master_endpoint():
    assert registry.master_endpoint("static", None, 7) == f"{registry.DEFAULT_MASTER_ADDR}:7"
    assert registry.master_endpoint("static", "::1", 7) == "[::1]:7"
    with pytest.raises(ValueError, match="does not take a master address"):
        registry.master_endpoint("etcd", "h", 1)
    with pytest.raises(ValueError, match="unknown rendezvous backend 'nope'"):
        registry.backend("nope")


def test_bad_hooks_are_refused(scratch_backends):
    with pytest.raises(ValueError, match="normalize hook .*module:function"):
        register_backend("x", Backend(lambda p: None, normalize="no_colon"))
    with pytest.raises(TypeError, match="parse_master hook"):
        register_backend("y", Backend(lambda p: None, parse_master=42))
    assert "x" not in registry.known_backends() and "y" not in registry.known_backends()


def _master_like(seen: list) -> Backend:
    """A plugin with the static backend's traits, under a name no agent code knows."""

    def factory(params):
        seen.append(params)
        return StaticRendezvousHandler(params)

    def parse(endpoint: str) -> tuple[str, int | None]:
        host, _, port = endpoint.rpartition(":")
        return host, int(port)

    return Backend(
        factory,
        endpoint_help="the master, as host:port",
        parse_master=parse,
        format_master=lambda host, port: f"{host}:{port}",
        node_rank_key="rank",
    )


def test_cli_and_launcher_treat_a_backend_by_its_traits(scratch_backends):
    seen: list = []
    register_backend("mine", _master_like(seen))
    c, _, _ = parse_args(
        [
            "--rdzv-backend",
            "mine",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "h",
            "t.py",
        ]
    )
    assert (c.rdzv_endpoint, c.master_addr, c.master_port) == ("h:29500", "h", 29500)
    assert c.rdzv_configs == {"rank": 1}
    # The launcher, without an endpoint: the master address and a free port, and the node rank.
    _make_rdzv_handler(LaunchConfig(max_nodes=2, node_rank=1, rdzv_backend="mine"))
    (p,) = seen
    host, port = p.endpoint.split(":")
    assert host == registry.DEFAULT_MASTER_ADDR and int(port) > 0
    assert p.config["rank"] == 1


def test_a_backend_without_traits_takes_its_endpoint_as_given(scratch_backends):
    register_backend("plain", lambda p: StaticRendezvousHandler(p))
    c, _, _ = parse_args(["--rdzv-backend", "plain", "--rdzv-endpoint", " as is ", "t.py"])
    assert (c.rdzv_endpoint, c.master_addr, c.rdzv_configs) == (" as is ", None, {})


def test_a_required_endpoint_comes_from_the_traits(scratch_backends):
    register_backend("needs", Backend(lambda p: None, endpoint_example="srv:1"))
    with pytest.raises(UsageError, match=r"required with --rdzv-backend needs \(e.g. .* srv:1\)"):
        parse_args(["--rdzv-backend", "needs", "t.py"])


@pytest.mark.parametrize("module", ["cli.py", "options.py", "launcher.py"])
def test_no_backend_name_is_typed_in_the_agent(module):
    names = set(registry.known_backends())
    tree = ast.parse((AGENT / module).read_text())
    typed = [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    ]
    assert typed == [], f"{module} names backends itself: {typed}"
