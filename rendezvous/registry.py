"""The registry of rendezvous backends: how to build each one, and what callers may know of it.

Why lazy entries ("module:function" strings resolved on first use): the etcd backend pulls in
gRPC and protobuf, and ``etcdrun --help`` or a static single-node run must not pay for them. Names
can be checked (``known_backends``) without importing any backend.

Why per-backend metadata (``Backend``): the command line and the launcher must treat a backend by
what it takes — an endpoint that names the master node (static), a required server endpoint to
normalise (etcd), a node rank — never by its name typed again in their code. The metadata is plain
data plus lazy hooks, so reading it loads no backend (``etcdrun --help`` lists the backends from
here: it costs this package's interface and errors modules, no gRPC, and a real run imports the
registry anyway; bench/results/figures.md).

A lazy entry names any callable that takes the RendezvousParameters and returns the handler: a
function (``create_rdzv_handler``, torch's name for the hook) or the handler class itself.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from etcdrun.rendezvous.api import RendezvousHandler, RendezvousParameters
from etcdrun.rendezvous.errors import RendezvousError

HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]

DEFAULT_BACKEND = "static"  # torchrun's default: nothing to install or start
STANDALONE_BACKEND = "static"  # what --standalone runs on: no server, a free local port
# Where the master node is when neither an endpoint nor a master address says: this machine.
DEFAULT_MASTER_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class Backend:
    """One registered backend: its factory, and what the CLI and launcher need to drive it.

    Hooks are callables or lazy "module:function" strings, loaded on first use.
    ``endpoint_help`` says what its ``--rdzv-endpoint`` is; ``endpoint_example`` set means an
    endpoint is required (the example goes into the message). ``normalize`` (str → str,
    ValueError when malformed) rewrites the endpoint the way the backend reads it.
    ``parse_master`` (str → (host, port or None)) and ``format_master`` ((host, port) → str) mark
    a backend whose endpoint *is* the master node's address, so that it may be built from
    ``--master-addr``/``--master-port``. ``node_rank_key`` is the config key ``--node-rank`` goes
    to (None: the backend assigns node ranks itself). ``pick_run_id`` ((run id, max nodes) →
    run id) marks a backend that refuses the default id and picks the one it runs under
    (None: the id as given).
    """

    factory: HandlerFactory | str
    endpoint_help: str = ""
    endpoint_example: str = ""
    normalize: Callable[[str], str] | str | None = None
    parse_master: Callable[[str], tuple[str, int | None]] | str | None = None
    format_master: Callable[[str, int], str] | str | None = None
    node_rank_key: str | None = None
    pick_run_id: Callable[[str, int], str] | str | None = None

    @property
    def takes_master(self) -> bool:
        return self.parse_master is not None and self.format_master is not None


@dataclass(frozen=True)
class EndpointInfo:
    """An endpoint as a backend reads it; ``master_*`` set when the endpoint names the master."""

    endpoint: str
    master_addr: str | None = None
    master_port: int | None = None


def _etcd_endpoints(text: str) -> str:
    from etcdrun.rendezvous.client.config import parse_endpoints

    return ",".join(str(e) for e in parse_endpoints(text))


_STATIC = Backend(
    "etcdrun.rendezvous.static.handler:create_rdzv_handler",
    endpoint_help="host:port of the master node",
    parse_master="etcdrun.rendezvous.static.handler:parse_static_endpoint",
    format_master="etcdrun.rendezvous.static.handler:format_endpoint",
    node_rank_key="rank",
)
_ETCD = Backend(
    "etcdrun.rendezvous.etcd.handler:EtcdRendezvousHandler",
    endpoint_help="comma list of [http[s]://]host[:port] (port 2379 when omitted)",
    endpoint_example="localhost:2379",
    normalize=_etcd_endpoints,
    pick_run_id="etcdrun.rendezvous.etcd.core.keys:one_node_run_id",
)

_lock = threading.Lock()
_backends: dict[str, Backend] = {
    "static": _STATIC,
    "etcd": _ETCD,
    # The name torchrun's plugin group uses for us; same backend.
    "etcd-v3": _ETCD,
}


def _check_hook(name: str, what: str, hook: object) -> None:
    if hook is None and what != "factory":
        return
    if isinstance(hook, str):
        if hook.count(":") != 1 or not all(hook.split(":")):
            raise ValueError(
                f"lazy {what} for backend {name!r} must be 'module:function', got {hook!r}"
            )
    elif not callable(hook):
        raise TypeError(f"{what} for backend {name!r} must be callable, got {hook!r}")


def register_backend(name: str, factory: HandlerFactory | str | Backend) -> None:
    """Register ``factory`` (a callable, a lazy ``"module:function"`` string, or a ``Backend``
    with its metadata) under ``name``.

    Registering the same backend twice is a no-op; a different one under a taken name is a
    ValueError, so two plugins cannot silently shadow each other. A bare factory is a backend
    that takes its endpoint as given, no master address and no node rank.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("The rendezvous backend name must be a non-empty string.")
    entry = factory if isinstance(factory, Backend) else Backend(factory)
    for what, hook in (
        ("factory", entry.factory),
        ("normalize hook", entry.normalize),
        ("parse_master hook", entry.parse_master),
        ("format_master hook", entry.format_master),
        ("pick_run_id hook", entry.pick_run_id),
    ):
        _check_hook(name, what, hook)
    with _lock:
        existing = _backends.get(name)
        if existing is not None and existing != entry:
            raise ValueError(f"rendezvous backend {name!r} is already registered")
        _backends[name] = entry


def known_backends() -> list[str]:
    """The registered names, sorted; importing nothing."""
    with _lock:
        return sorted(_backends)


def backend(name: str) -> Backend:
    """``name``'s entry (importing nothing); an unknown name is a ValueError listing the known."""
    with _lock:
        entry = _backends.get(name)
    if entry is None:
        hint = _TORCHRUN_NAMES.get(name, "")
        raise ValueError(
            f"unknown rendezvous backend {name!r}{hint}; known backends: "
            f"{', '.join(known_backends())}"
        )
    return entry


# torchrun's own names: someone switching over gets the one word to change, not a list to read
_TORCHRUN_NAMES = dict.fromkeys(
    ("c10d", "etcd-v2"),
    " (torchrun's: under etcdrun an elastic job's rendezvous is --rdzv-backend etcd, with "
    "--rdzv-endpoint naming an etcd v3, host:2379)",
)


def backend_groups() -> list[tuple[str, list[str], Backend]]:
    """(name, aliases, entry) once per backend, in registration order: names registered with
    an equal entry are aliases of the first one.
    """
    with _lock:
        items = list(_backends.items())
    groups: list[tuple[str, list[str], Backend]] = []
    for name, entry in items:
        group = next((g for g in groups if g[2] == entry), None)
        if group is None:
            groups.append((name, [], entry))
        else:
            group[1].append(name)
    return groups


def describe_backends() -> str:
    """The names for a help text, aliases with their backend: "static, etcd (alias etcd-v3)"."""
    return ", ".join(
        name + (f" (alias {', '.join(aliases)})" if aliases else "")
        for name, aliases, _ in backend_groups()
    )


def _load(hook: Callable[..., Any] | str, name: str, run_id: str | None) -> Any:
    if not isinstance(hook, str):
        return hook
    module_name, attr = hook.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RendezvousError(
            f"rendezvous backend {name!r} could not be loaded from {module_name}: {exc}",
            run_id=run_id,
        ) from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RendezvousError(
            f"rendezvous backend {name!r}: {module_name} has no callable {attr}()",
            run_id=run_id,
        )
    return fn


def _resolve(name: str, run_id: str) -> HandlerFactory:
    return _load(backend(name).factory, name, run_id)


def read_endpoint(name: str, endpoint: str) -> EndpointInfo:
    """``endpoint`` as backend ``name`` reads it: normalised and, for a backend whose endpoint
    is the master node, that node's host and port. A malformed endpoint is a ValueError.
    """
    entry = backend(name)
    if entry.normalize is not None:
        endpoint = _load(entry.normalize, name, None)(endpoint)
    if entry.parse_master is None:
        return EndpointInfo(endpoint)
    host, port = _load(entry.parse_master, name, None)(endpoint)
    return EndpointInfo(endpoint, host, port)


def master_endpoint(name: str, host: str | None, port: int) -> str:
    """The endpoint of backend ``name`` (one that ``takes_master``) for the master node
    ``host`` (None: ``DEFAULT_MASTER_ADDR``) and ``port``.
    """
    entry = backend(name)
    if entry.format_master is None:
        raise ValueError(f"rendezvous backend {name!r} does not take a master address")
    return _load(entry.format_master, name, None)(host or DEFAULT_MASTER_ADDR, port)


def pick_run_id(name: str, run_id: str, max_nodes: int) -> str:
    """The run id backend ``name`` runs a job of at most ``max_nodes`` nodes under: ``run_id``,
    unless the backend picks another (etcd: a unique one for a one-node job given none).
    """
    entry = backend(name)
    if entry.pick_run_id is None:
        return run_id
    return _load(entry.pick_run_id, name, run_id)(run_id, max_nodes)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build ``params.backend``'s handler; an unknown name is a ValueError listing the known."""
    handler = _resolve(params.backend, params.run_id)(params)
    if not isinstance(handler, RendezvousHandler):
        raise TypeError(
            f"rendezvous backend {params.backend!r} returned {type(handler).__name__}, "
            "not a RendezvousHandler"
        )
    return handler


__all__ = [
    "DEFAULT_BACKEND",
    "DEFAULT_MASTER_ADDR",
    "STANDALONE_BACKEND",
    "Backend",
    "EndpointInfo",
    "HandlerFactory",
    "backend",
    "backend_groups",
    "create_handler",
    "describe_backends",
    "known_backends",
    "master_endpoint",
    "pick_run_id",
    "read_endpoint",
    "register_backend",
]
