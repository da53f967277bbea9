"""etcdrun's own etcd v3 client (see client.py for why)."""

# First: gRPC's log level, set for its import only (_grpc_quiet.py says why).
from etcdrun.rendezvous.client import _grpc_quiet  # noqa: F401, I001
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
