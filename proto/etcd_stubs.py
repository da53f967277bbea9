"""etcd's RPC paths, bound to our own message classes.

Why by hand: our messages live in the proto package ``etcdrun.etcdapi`` (no descriptor-pool clash
with another etcd library), but etcd serves ``/etcdserverpb.KV/Range`` and friends. Generated
service stubs would derive the path from our package name, so we bind each path here instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from etcdrun.proto import etcd_api_pb2 as pb


class Method(NamedTuple):
    path: str
    request: type
    response: type
    streaming: bool  # bidirectional stream (Watch, LeaseKeepAlive); unary otherwise


def _m(service: str, name: str, req: str, resp: str, streaming: bool = False) -> Method:
    return Method(f"/etcdserverpb.{service}/{name}", getattr(pb, req), getattr(pb, resp), streaming)


METHODS: dict[str, Method] = {
    "Range": _m("KV", "Range", "RangeRequest", "RangeResponse"),
    "Put": _m("KV", "Put", "PutRequest", "PutResponse"),
    "DeleteRange": _m("KV", "DeleteRange", "DeleteRangeRequest", "DeleteRangeResponse"),
    "Txn": _m("KV", "Txn", "TxnRequest", "TxnResponse"),
    "Compact": _m("KV", "Compact", "CompactionRequest", "CompactionResponse"),
    "Watch": _m("Watch", "Watch", "WatchRequest", "WatchResponse", streaming=True),
    "LeaseGrant": _m("Lease", "LeaseGrant", "LeaseGrantRequest", "LeaseGrantResponse"),
    "LeaseRevoke": _m("Lease", "LeaseRevoke", "LeaseRevokeRequest", "LeaseRevokeResponse"),
    "LeaseKeepAlive": _m(
        "Lease", "LeaseKeepAlive", "LeaseKeepAliveRequest", "LeaseKeepAliveResponse", True
    ),
    "LeaseTimeToLive": _m(
        "Lease", "LeaseTimeToLive", "LeaseTimeToLiveRequest", "LeaseTimeToLiveResponse"
    ),
    "LeaseLeases": _m("Lease", "LeaseLeases", "LeaseLeasesRequest", "LeaseLeasesResponse"),
    "MemberList": _m("Cluster", "MemberList", "MemberListRequest", "MemberListResponse"),
    "Status": _m("Maintenance", "Status", "StatusRequest", "StatusResponse"),
    "Authenticate": _m("Auth", "Authenticate", "AuthenticateRequest", "AuthenticateResponse"),
    "AuthEnable": _m("Auth", "AuthEnable", "AuthEnableRequest", "AuthEnableResponse"),
    "UserAdd": _m("Auth", "UserAdd", "AuthUserAddRequest", "AuthUserAddResponse"),
    "RoleAdd": _m("Auth", "RoleAdd", "AuthRoleAddRequest", "AuthRoleAddResponse"),
    "UserGrantRole": _m(
        "Auth", "UserGrantRole", "AuthUserGrantRoleRequest", "AuthUserGrantRoleResponse"
    ),
    "RoleGrantPermission": _m(
        "Auth",
        "RoleGrantPermission",
        "AuthRoleGrantPermissionRequest",
        "AuthRoleGrantPermissionResponse",
    ),
}


def bind(channel: Any, name: str) -> Any:
    """Return a callable for ``name`` on ``channel`` (a ``grpc.Channel``)."""
    m = METHODS[name]
    factory = channel.stream_stream if m.streaming else channel.unary_unary
    return factory(
        m.path,
        request_serializer=m.request.SerializeToString,
        response_deserializer=m.response.FromString,
    )
