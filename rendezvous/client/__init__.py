"""etcdrun's own etcd v3 client (see client.py for why)."""

import os

# gRPC's C core logs at INFO in some builds (e.g. "Handshake failed ..." on stderr); an agent's
# stderr carries one clear line per problem, ours. Set before anything imports grpc; a user's
# own setting wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from etcdrun.rendezvous.client.client import EtcdClient, RangeResult, TxnResult
from etcdrun.rendezvous.client.config import ClientConfig, Endpoint, parse_endpoints
from etcdrun.rendezvous.client.errors import (
    EtcdAuthError,
    EtcdClosedError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdEndpointError,
    EtcdError,
    EtcdLeaseNotFoundError,
    EtcdNoSpaceError,
    EtcdPermissionError,
    EtcdRequestError,
    EtcdTokenExpiredError,
)
from etcdrun.rendezvous.client.lease import Lease
from etcdrun.rendezvous.client.policy import RetryPolicy
from etcdrun.rendezvous.client.watch import Watch, WatchBatch

__all__ = [
    "ClientConfig",
    "Endpoint",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdClosedError",
    "EtcdCompactedError",
    "EtcdConnectionError",
    "EtcdEndpointError",
    "EtcdError",
    "EtcdLeaseNotFoundError",
    "EtcdNoSpaceError",
    "EtcdPermissionError",
    "EtcdRequestError",
    "EtcdTokenExpiredError",
    "Lease",
    "RangeResult",
    "RetryPolicy",
    "TxnResult",
    "Watch",
    "WatchBatch",
    "parse_endpoints",
]
