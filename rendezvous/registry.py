"""The registry of rendezvous backends behind ``create_handler``.

Why lazy entries ("module:function" strings resolved on first use): the etcd backend pulls in
gRPC and protobuf, and ``etcdrun --help`` or a static single-node run must not pay for them. Names
can be checked (``known_backends``) without importing any backend.

A lazy entry names any callable that takes the RendezvousParameters and returns the handler: a
function (``create_rdzv_handler``, torch's name for the hook) or the handler class itself.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

from etcdrun.rendezvous.api import RendezvousHandler, RendezvousParameters
from etcdrun.rendezvous.errors import RendezvousError

HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]

_ETCD = "etcdrun.rendezvous.etcd_rendezvous:EtcdRendezvousHandler"

_lock = threading.Lock()
_backends: dict[str, HandlerFactory | str] = {
    "static": "etcdrun.rendezvous.static:create_rdzv_handler",
    "etcd": _ETCD,
    # The name torchrun's plugin group uses for us; same backend.
    "etcd-v3": _ETCD,
}


def register_backend(name: str, factory: HandlerFactory | str) -> None:
    """Register ``factory`` (a callable, or a lazy ``"module:function"`` string) under ``name``.

    Registering the same factory twice is a no-op; a different factory under a taken name is a
    ValueError, so two plugins cannot silently shadow each other.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("The rendezvous backend name must be a non-empty string.")
    if isinstance(factory, str):
        if factory.count(":") != 1 or not all(factory.split(":")):
            raise ValueError(
                f"lazy factory for backend {name!r} must be 'module:function', got {factory!r}"
            )
    elif not callable(factory):
        raise TypeError(f"factory for backend {name!r} must be callable, got {factory!r}")
    with _lock:
        existing = _backends.get(name)
        if existing is not None and existing != factory:
            raise ValueError(f"rendezvous backend {name!r} is already registered")
        _backends[name] = factory


def known_backends() -> list[str]:
    """The registered names, sorted; importing nothing."""
    with _lock:
        return sorted(_backends)


def check_backend(name: str) -> None:
    """Raise the unknown-backend ValueError for ``name``, without importing the backend."""
    with _lock:
        known = name in _backends
    if not known:
        raise ValueError(
            f"unknown rendezvous backend {name!r}; known backends: {', '.join(known_backends())}"
        )


def _resolve(name: str, run_id: str) -> HandlerFactory:
    check_backend(name)
    with _lock:
        entry = _backends[name]
    if not isinstance(entry, str):
        return entry
    module_name, attr = entry.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RendezvousError(
            f"rendezvous backend {name!r} could not be loaded from {module_name}: {exc}",
            run_id=run_id,
        ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise RendezvousError(
            f"rendezvous backend {name!r}: {module_name} has no callable {attr}()",
            run_id=run_id,
        )
    return factory


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
    "HandlerFactory",
    "check_backend",
    "create_handler",
    "known_backends",
    "register_backend",
]
