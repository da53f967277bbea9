"""etcdrun's own etcd v3 client (see client.py for why)."""

from etcdrun.rendezvous.client.client import EtcdClient, RangeResult, TxnResult
from etcdrun.rendezvous.client.config import ClientConfig, Endpoint, parse_endpoints
from etcdrun.rendezvous.client.errors import (
    EtcdAuthError,
    EtcdClosedError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdLeaseNotFoundError,
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
    "EtcdError",
    "EtcdLeaseNotFoundError",
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
