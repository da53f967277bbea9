"""Typed errors for the etcd client: one root, a few leaves, never a raw grpc exception.

Why: callers decide by kind (retry? re-login? give up with a clear line?) and the messages name
the endpoint and etcd's own reason, which is what a user needs to fix a misconfiguration.
"""

from __future__ import annotations  # noqa: I001 - _grpc_quiet first

from etcdrun.rendezvous.client import _grpc_quiet  # noqa: F401 - GRPC_VERBOSITY, before grpc

import grpc


class EtcdError(Exception):
    """Root of every etcd client error."""

    def __init__(self, message: str, *, endpoint: str | None = None, code: str | None = None):
        self.endpoint = endpoint
        self.code = code
        super().__init__(f"{message} [{endpoint}]" if endpoint else message)


class EtcdConnectionError(EtcdError):
    """No endpoint answered within the retry budget (down, unreachable, no leader)."""


class EtcdEndpointError(EtcdConnectionError):
    """The endpoint answers, but not as configured: a TLS handshake that fails (wrong CA,
    https:// to a plain etcd) or a server that is no etcd. Retrying cannot fix it.
    """


class EtcdAuthError(EtcdError):
    """Authentication failed: wrong user or password, or auth misconfigured."""


class EtcdTokenExpiredError(EtcdAuthError):
    """Our auth token expired or went stale: the client logs in again by itself."""


class EtcdPermissionError(EtcdError):
    """The user is authenticated but its roles do not cover the key."""


class EtcdCompactedError(EtcdError):
    """The requested revision was compacted away; ``compact_revision`` is the oldest one left."""

    def __init__(self, message: str, *, compact_revision: int = 0, **kw):
        self.compact_revision = compact_revision
        super().__init__(message, **kw)


class EtcdLeaseNotFoundError(EtcdError):
    """The lease expired or was revoked on the server."""


class EtcdRequestError(EtcdError):
    """etcd rejected the request itself (invalid argument, too large, ...)."""


class EtcdNoSpaceError(EtcdRequestError):
    """etcd's space quota is exhausted: it refuses every write until an operator frees space."""


NO_SPACE_REMEDY = (
    "etcd's space quota is exhausted (mvcc: database space exceeded): it takes no writes until "
    "an operator frees space: etcdctl compact <current revision>; etcdctl defrag; "
    "etcdctl alarm disarm"
)


class EtcdClosedError(EtcdError):
    """The client was closed."""


# etcd's error strings (server/etcdserver/api/v3rpc/rpctypes) that decide the error's kind.
_INVALID_TOKEN = ("invalid auth token", "revision of auth store is old", "auth token is expired")
_NO_SPACE = "database space exceeded"
# What gRPC says when the far end is not what we are configured to talk to (measured: wrong CA,
# https:// to a plain etcd, an HTTP/1 server). Only trusted before the first success: afterwards
# the same words may come from a TLS etcd restarting mid-handshake, which retrying does heal.
_NOT_AS_CONFIGURED = (
    "handshake failed",
    "handshake read failed",
    "certificate_verify_failed",
    "wrong_version_number",
    "failed parsing http/2",
    "http1.x server",
)
# gRPC's fork handlers close the connections a child inherits; a child's first call can still
# meet one ("Stream removed (Closed on fork)"), and its next attempt opens a new one.
_CLOSED_ON_FORK = "closed on fork"
_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def is_token_expired(exc: BaseException) -> bool:
    """True when etcd refused the request only because our auth token is stale."""
    details = _details(exc)
    return any(s in details for s in _INVALID_TOKEN)


def is_transient(exc: BaseException) -> bool:
    """True when another attempt (maybe on another endpoint) may succeed."""
    if isinstance(exc, grpc.RpcError):
        if _NO_SPACE in _details(exc):
            return False
        if _CLOSED_ON_FORK in _details(exc).lower():
            return True
        return exc.code() in _TRANSIENT_CODES and not is_token_expired(exc)
    return isinstance(exc, EtcdConnectionError) and not isinstance(exc, EtcdEndpointError)


def is_not_as_configured(exc: BaseException) -> bool:
    """True when the far end answers, but not as configured (TLS, not an etcd)."""
    details = _details(exc).lower()
    return any(s in details for s in _NOT_AS_CONFIGURED)


def _details(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return (exc.details() or "") if hasattr(exc, "details") else str(exc)
    return str(exc)


def from_rpc_error(exc: grpc.RpcError, endpoint: str | None = None) -> EtcdError:
    """Translate a grpc error into the client's typed errors."""
    code = exc.code() if hasattr(exc, "code") else None
    details = _details(exc)
    name = code.name if code is not None else None
    text = f"etcd: {details or name}"
    kw = {"endpoint": endpoint, "code": name}
    if _NO_SPACE in details:
        return EtcdNoSpaceError(f"{NO_SPACE_REMEDY} [{details}]", **kw)
    if "permission denied" in details or code == grpc.StatusCode.PERMISSION_DENIED:
        return EtcdPermissionError(text, **kw)
    if "compacted" in details:
        return EtcdCompactedError(text, **kw)
    if "lease not found" in details:
        return EtcdLeaseNotFoundError(text, **kw)
    if is_token_expired(exc):
        return EtcdTokenExpiredError(text, **kw)
    if (
        code == grpc.StatusCode.UNAUTHENTICATED
        or "authentication failed" in details
        or "user name" in details
        or "authentication is not enabled" in details
    ):
        return EtcdAuthError(text, **kw)
    if code in _TRANSIENT_CODES or code == grpc.StatusCode.CANCELLED:
        return EtcdConnectionError(text, **kw)
    return EtcdRequestError(text, **kw)
