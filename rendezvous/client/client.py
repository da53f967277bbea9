"""EtcdClient: the thin etcd v3 client etcdrun runs on.

Why our own: no maintained Python etcd v3 client resumes watches, keeps leases alive across
failover, logs in again when the token expires, and imports cleanly on protobuf 5–7 (see the
foundation issue). This one is a thin layer over grpc with those four properties and typed errors.

Lifecycle: create (no I/O yet: channels open lazily, so a client made before ``fork()`` works in
the child too, even while its keep-alive, watch or other threads are busy in the parent: forks.py
holds them out of gRPC across the fork), use, ``close()`` — which revokes the leases it keeps
alive, ends its watches and joins its two threads (keep-alive, watch), each started only when
first needed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.client.config import ClientConfig
from etcdrun.rendezvous.client.keeper import KeepAliveRelay, KeepAliveStats, LeaseKeeper
from etcdrun.rendezvous.client.lease import Lease
from etcdrun.rendezvous.client.policy import RetryPolicy
from etcdrun.rendezvous.client.transport import Transport
from etcdrun.rendezvous.client.watch import Watch, WatchBatch, WatchManager

Key = t.Key


class RangeResult(NamedTuple):
    kvs: list  # of etcd_api_pb2.KeyValue
    revision: int  # the store's revision the read saw
    count: int
    more: bool


class TxnResult(NamedTuple):
    succeeded: bool
    responses: list  # of etcd_api_pb2.ResponseOp
    revision: int
    term: int = 0  # the raft term of the member that answered (0: not known)


class EtcdClient:
    """A thread-safe client for one etcd cluster (any number of endpoints)."""

    def __init__(
        self,
        endpoints: str | Sequence[str] | ClientConfig,
        *,
        keepalive_relay: KeepAliveRelay | None = None,
        **kw,
    ) -> None:
        config = (
            endpoints
            if isinstance(endpoints, ClientConfig)
            else ClientConfig.create(endpoints, **kw)
        )
        self.config = config
        self._t = Transport(config)
        self._leases = LeaseKeeper(self._t, keepalive_relay)
        self._watches = WatchManager(self._t)
        self._pid = os.getpid()

    def observe(self, observer: Callable[[str, float, str | None], None] | None) -> None:
        """Call ``observer(method, seconds, error)`` after every unary call (retries and
        failover included; ``error``: the EtcdError's class name, or None); None stops it. For
        metrics (agent/report/metrics.py); unobserved, a call pays one attribute test.
        """
        self._t.observer = observer

    # ---- KV ----------------------------------------------------------------------------------
    def range(
        self,
        key: Key,
        range_end: Key | None = None,
        *,
        prefix: bool = False,
        revision: int = 0,
        limit: int = 0,
        keys_only: bool = False,
        count_only: bool = False,
        serializable: bool = False,
        sort: tuple[str, str] | None = None,
        max_create_revision: int = 0,
        min_create_revision: int = 0,
        timeout: float | None = None,
    ) -> RangeResult:
        """Read a key or range. ``sort=("create", "descend")`` and friends order the result."""
        end = t.range_end(key, prefix, range_end)
        req = pb.RangeRequest(
            key=t.to_bytes(key),
            range_end=end,
            revision=revision,
            limit=limit,
            keys_only=keys_only,
            count_only=count_only,
            serializable=serializable,
            max_create_revision=max_create_revision,
            min_create_revision=min_create_revision,
        )
        if sort:
            req.sort_target = pb.RangeRequest.SortTarget.Value(sort[0].upper())
            req.sort_order = pb.RangeRequest.SortOrder.Value(sort[1].upper())
        resp = self._t.call("Range", req, timeout=timeout)
        return RangeResult(list(resp.kvs), resp.header.revision, resp.count, resp.more)

    def get(self, key: Key, **kw) -> pb.KeyValue | None:
        """One key's KeyValue (with its revisions), or None."""
        kvs = self.range(key, **kw).kvs
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: Key, **kw) -> RangeResult:
        return self.range(prefix, prefix=True, **kw)

    def put(
        self, key: Key, value: bytes | str, lease: int | Lease = 0, timeout: float | None = None
    ) -> int:
        """Write; return the store revision of the write."""
        req = pb.PutRequest(key=t.to_bytes(key), value=t.to_bytes(value), lease=_lid(lease))
        return self._t.call("Put", req, timeout=timeout).header.revision

    def delete(
        self,
        key: Key,
        *,
        prefix: bool = False,
        range_end: Key | None = None,
        timeout: float | None = None,
    ) -> int:
        """Delete a key or range; return how many keys were deleted."""
        op = t.delete(key, prefix, range_end).request_delete_range
        return self._t.call("DeleteRange", op, timeout=timeout).deleted

    def txn(
        self,
        compare: Sequence[pb.Compare],
        success: Sequence[pb.RequestOp] = (),
        failure: Sequence[pb.RequestOp] = (),
        timeout: float | None = None,
    ) -> TxnResult:
        """One atomic if/then/else (build parts with etcdrun.rendezvous.client.txn)."""
        req = pb.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        resp = self._t.call("Txn", req, timeout=timeout)
        return TxnResult(
            resp.succeeded, list(resp.responses), resp.header.revision, resp.header.raft_term
        )

    def compact(self, revision: int, physical: bool = True) -> None:
        self._t.call("Compact", pb.CompactionRequest(revision=revision, physical=physical))

    # ---- leases ------------------------------------------------------------------------------
    def lease(self, ttl: int, keepalive: bool = True) -> Lease:
        """Grant a lease; by default keep it alive until revoked, lost, or the client closes."""
        return self._leases.grant(ttl, keepalive)

    def keep_alive(self, lease_id: int) -> Lease:
        """Keep alive a lease another client granted (until revoked, orphaned, lost, or this
        client closes — closing revokes what it keeps: ``orphan()`` a lease meant to outlive
        this client).
        """
        return self._leases.adopt(lease_id)

    def revoke(self, lease_id: int, timeout: float | None = None) -> bool:
        """Revoke a lease by id (its keys vanish at once); True when gone (or already gone)."""
        return self._leases.revoke(lease_id, timeout)

    def lease_ttl(self, lease: int | Lease) -> pb.LeaseTimeToLiveResponse:
        return self._t.call("LeaseTimeToLive", pb.LeaseTimeToLiveRequest(ID=_lid(lease)))

    def keepalive_stats(self, reset: bool = False) -> KeepAliveStats:
        """This client's keep-alive counters (``reset``: start a new window for the maxima)."""
        return self._leases.stats(reset)

    def leases(self) -> list[int]:
        """IDs of every lease on the server (all clients)."""
        return [s.ID for s in self._t.call("LeaseLeases", pb.LeaseLeasesRequest()).leases]

    # ---- watches -----------------------------------------------------------------------------
    def watch(
        self,
        key: Key,
        *,
        prefix: bool = False,
        range_end: Key | None = None,
        start_revision: int = 0,
        prev_kv: bool = False,
        callback: Callable[[WatchBatch], None] | None = None,
    ) -> Watch:
        """Watch a key or range from ``start_revision`` (inclusive; pass the revision you read
        plus one, so nothing between your read and the watch is missed).
        """
        end = t.range_end(key, prefix, range_end)
        return self._watches.watch(t.to_bytes(key), end, start_revision, prev_kv, callback)

    # ---- cluster -----------------------------------------------------------------------------
    def status(self, endpoint_index: int | None = None) -> pb.StatusResponse:
        """Maintenance Status of one member (the preferred one by default)."""
        if endpoint_index is None:
            return self._t.call("Status", pb.StatusRequest())
        return self._t.call_on(endpoint_index, "Status", pb.StatusRequest())

    def members(self) -> list[pb.Member]:
        return list(self._t.call("MemberList", pb.MemberListRequest()).members)

    # ---- auth administration (tests, deploy scripts) -----------------------------------------
    def user_add(self, name: str, password: str) -> None:
        self._t.call("UserAdd", pb.AuthUserAddRequest(name=name, password=password))

    def role_add(self, name: str) -> None:
        self._t.call("RoleAdd", pb.AuthRoleAddRequest(name=name))

    def role_grant_prefix(self, role: str, prefix: Key, perm: str = "READWRITE") -> None:
        p = pb.Permission(
            permType=pb.Permission.Type.Value(perm),
            key=t.to_bytes(prefix),
            range_end=t.prefix_end(prefix),
        )
        self._t.call("RoleGrantPermission", pb.AuthRoleGrantPermissionRequest(name=role, perm=p))

    def user_grant_role(self, user: str, role: str) -> None:
        self._t.call("UserGrantRole", pb.AuthUserGrantRoleRequest(user=user, role=role))

    def auth_enable(self) -> None:
        self._t.call("AuthEnable", pb.AuthEnableRequest())

    # ---- lifecycle ---------------------------------------------------------------------------
    @property
    def policy(self) -> RetryPolicy:
        """The retry and timeout policy of this client (and of the rendezvous built on it)."""
        return self._t.policy

    @property
    def reached(self) -> bool:
        """Whether etcd ever answered a call of this client."""
        return self._t.answered

    @property
    def endpoints(self) -> str:
        return self._t.endpoints_text()

    def outage(self) -> tuple[float, float] | None:
        """(since, giving up at), wall clock, while etcd does not answer; None while it does."""
        return self._t.outage()

    @property
    def watch_reconnects(self) -> int:
        return self._watches.reconnects

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (what is built on the client may let go then)."""
        return self._t.closed

    def close(self, revoke_leases: bool = True) -> None:
        """End watches, revoke kept-alive leases (bounded), stop threads, close channels.
        Idempotent. In a forked child, only forgets the parent's state.
        """
        if os.getpid() != self._pid:
            self._t.close()
            return
        self._watches.close()
        if not self._t.closed:
            self._leases.close(revoke=revoke_leases)
        self._t.close()

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lid(lease: int | Lease) -> int:
    return lease.id if isinstance(lease, Lease) else int(lease)
