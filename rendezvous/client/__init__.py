"""etcdrun's own etcd v3 client (see client.py for why).

Why the names load on first use (PEP 562 ``__getattr__``): the command line normalises
``--rdzv-endpoint`` with ``parse_endpoints`` (config.py, standard library only) while it parses, and
importing gRPC and protobuf with it delayed everything after the parse, the standby workers' start
among them (agent/launcher.py starts them before the rendezvous handler, so that their ``import
torch`` runs beside it: bench/results/figures.md, 'Design notes' figures', §4, the early fork).
gRPC's log level is still set before gRPC's import: every module here that imports grpc
imports ``_grpc_quiet`` first.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "EtcdClient": "client",
    "RangeResult": "client",
    "TxnResult": "client",
    "ClientConfig": "config",
    "Endpoint": "config",
    "parse_endpoints": "config",
    "EtcdAuthError": "errors",
    "EtcdClosedError": "errors",
    "EtcdCompactedError": "errors",
    "EtcdConnectionError": "errors",
    "EtcdEndpointError": "errors",
    "EtcdError": "errors",
    "EtcdLeaseNotFoundError": "errors",
    "EtcdNoSpaceError": "errors",
    "EtcdPermissionError": "errors",
    "EtcdRequestError": "errors",
    "EtcdTokenExpiredError": "errors",
    "KeepAliveStats": "keeper",
    "Lease": "lease",
    "LeaseLoss": "lease",
    "RetryPolicy": "policy",
    "Watch": "watch",
    "WatchBatch": "watch",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value
    return value
