"""Channels to etcd's endpoints, failover, retry, auth tokens, and fork safety.

Why one place: every unary call and every stream (watch, keep-alive) needs the same three things —
a live channel to some endpoint, the current auth token, and a rule for what to do on failure.

- Failover: calls go to the preferred endpoint; a transient failure (UNAVAILABLE, our short
  DEADLINE_EXCEEDED) moves the preference to the next endpoint and retries (tenacity), within
  ``retry_timeout`` — all of it as the one RetryPolicy (policy.py) says.
- Auth: when the token expires (``etcdserver: invalid auth token``), log in again once and retry.
- Fork: a grpc channel created before ``fork()`` is broken in the child (measured). Channels are
  created lazily and dropped — never reused — when the process id changes; and every call passes
  forks.GATE, so that none is inside gRPC when the process forks (a child inheriting one aborts
  or hangs in its first request).
- Idempotence: a Put or Txn whose answer was lost may have been applied; a retried Txn then fails
  its compare, and callers re-read (the rendezvous fences every write on mod_revision).
"""

from __future__ import annotations  # noqa: I001 - _grpc_quiet first

from etcdrun.rendezvous.client import _grpc_quiet  # noqa: F401 - GRPC_VERBOSITY, before grpc

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto.etcd_stubs import bind
from etcdrun.rendezvous.client.config import ClientConfig, Endpoint
from etcdrun.rendezvous.client.forks import GATE
from etcdrun.rendezvous.client.errors import (
    EtcdClosedError,
    EtcdConnectionError,
    EtcdEndpointError,
    EtcdError,
    EtcdTokenExpiredError,
    from_rpc_error,
    is_not_as_configured,
    is_token_expired,
    is_transient,
)

log = logging.getLogger(__name__)

# Reconnect fast after an etcd restart (grpc's default backoff grows to 120 s); keep-alive pings
# no more often than etcd's --grpc-keepalive-min-time (5 s) allows, and only with open streams.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.enable_retries", 0),
]


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


class Transport:
    """Owns the channels and the auth token; everything else calls through it."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.policy = config.policy
        self._lock = threading.Lock()
        self._channels: dict[int, grpc.Channel] = {}
        self._pid = os.getpid()
        self._preferred = 0
        self._token: str | None = None
        self._closed = False
        self.observer: Any = None  # (method, seconds, error) after each call: EtcdClient.observe
        self._answered = False  # some call succeeded: the configuration is known to be right
        self._outage: float | None = None  # monotonic start of the current outage, if any
        self._credentials = None
        if config.tls or any(ep.secure for ep in config.endpoints):
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(config.ca_cert),
                private_key=_read(config.key),
                certificate_chain=_read(config.cert),
            )

    # ---- channels -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            # The parent's channels are unusable here, and closing them could disturb the parent.
            self._channels = {}
            self._pid = os.getpid()
            self._lock = threading.Lock()

    def channel(self, index: int) -> grpc.Channel:
        self._check_fork()
        with self._lock:
            if self._closed:
                raise EtcdClosedError("etcd client is closed")
            ch = self._channels.get(index)
            if ch is None:
                ep = self.config.endpoints[index]
                if self.config.secure(ep):
                    if self._credentials is None:
                        self._credentials = grpc.ssl_channel_credentials()
                    ch = grpc.secure_channel(ep.target, self._credentials, CHANNEL_OPTIONS)
                else:
                    ch = grpc.insecure_channel(ep.target, CHANNEL_OPTIONS)
                self._channels[index] = ch
            return ch

    def preferred(self) -> int:
        return self._preferred

    def fail_over(self, index: int) -> None:
        """Move the preference past ``index`` (unless someone already did)."""
        with self._lock:
            if self._preferred == index:
                self._preferred = (index + 1) % len(self.config.endpoints)

    def endpoint(self, index: int) -> Endpoint:
        return self.config.endpoints[index]

    # ---- auth ------------------------------------------------------------------------------
    def metadata(self, streaming: bool = False) -> list[tuple[str, str]]:
        md = []
        if self.config.user is not None:
            md.append(("token", self._token or self.login()))
        if streaming:
            # A member cut off from the leader cancels the stream instead of going silent.
            md.append(("hasleader", "true"))
        return md

    @property
    def token(self) -> str | None:
        return self._token

    def login(self, stale: str | None = None) -> str:
        """Authenticate and return the token (a no-op when another thread already refreshed
        ``stale``).
        """
        with self._lock:
            if self._token is not None and self._token != stale:
                return self._token
        req = pb.AuthenticateRequest(name=self.config.user, password=self.config.password)

        def attempt(idx: int) -> Any:
            with GATE.call():
                return bind(self.channel(idx), "Authenticate")(
                    req, timeout=self.policy.request_timeout
                )

        resp = self._retrying(attempt)
        with self._lock:
            self._token = resp.token
        log.debug("etcd: logged in as %s", self.config.user)
        return resp.token

    # ---- calls -----------------------------------------------------------------------------
    def _retrying(self, attempt, timeout: float | None = None) -> Any:
        """Run ``attempt(endpoint_index)`` with failover and backoff; raise typed errors.

        The first try runs bare: building a tenacity loop costs a good share of a local Range
        (bench/results/figures.md), and almost every call succeeds the first
        time.
        """
        idx = self._preferred
        try:
            return self._answer(attempt(idx))
        except grpc.RpcError as e:
            if not self._retryable(e):
                raise self._final(e, idx) from None
            self.fail_over(idx)
        except ValueError as e:  # grpc raises it for calls on a closed channel
            raise self._closed_or(e) from None
        return self._retry(attempt, timeout)

    def _retry(self, attempt, timeout: float | None) -> Any:
        """The retries after a failed first try, as the policy says (failover, backoff)."""
        n = len(self.config.endpoints)
        self._outage_begins()
        timeout = self._within_outage(timeout)
        retryer = self.policy.retrying(n, lambda: self._closed, timeout, self._retryable)
        last_index = [self._preferred]

        def one() -> Any:
            idx = self._preferred
            last_index[0] = idx
            try:
                return attempt(idx)
            except grpc.RpcError as e:
                if is_transient(e):
                    self.fail_over(idx)
                raise

        try:
            return self._answer(retryer(one))
        except grpc.RpcError as e:
            if self._retryable(e):
                detail = e.details() or e.code().name
                hint = (
                    "; if that etcd serves TLS, use https:// and give its CA (cacert)"
                    if "socket closed" in detail.lower() and not self.config.tls
                    else ""
                )
                raise EtcdConnectionError(
                    f"etcd unreachable at {self.endpoints_text()} (gRPC: {detail}){hint}",
                    code=e.code().name,
                ) from None
            raise self._final(e, last_index[0]) from None
        except ValueError as e:
            raise self._closed_or(e) from None

    def _retryable(self, e: grpc.RpcError) -> bool:
        """Transient, unless the far end answered as something we are not configured to talk
        to before any call ever succeeded (TLS refused, not an etcd): that does not heal.
        """
        return is_transient(e) and (self._answered or not is_not_as_configured(e))

    def _final(self, e: grpc.RpcError, idx: int) -> EtcdError:
        if is_transient(e) and is_not_as_configured(e):
            return EtcdEndpointError(
                f"etcd at {self.endpoint(idx)} does not answer as configured: "
                f"{e.details() or e.code().name} (check the endpoint's scheme, http:// or "
                "https://, and the TLS files: cacert, cert, key)",
                code=e.code().name,
            )
        return from_rpc_error(e, str(self.endpoint(idx)))

    @property
    def answered(self) -> bool:
        """Whether any call ever succeeded (so the endpoint and the TLS setup are right)."""
        return self._answered

    def _answer(self, resp: Any) -> Any:
        self.answered_now()
        self._answered = True
        return resp

    def answered_now(self) -> None:
        """etcd answered (a call, a keep-alive, a watch message): an outage, if any, is over."""
        if self._outage is not None:
            log.warning(
                "etcd at %s reachable again after %.1f s",
                self.endpoints_text(),
                time.monotonic() - self._outage,
            )
            self._outage = None

    def _outage_begins(self) -> None:
        """Say once per outage what is happening, since when, and when the client gives up."""
        if self._outage is not None:
            return
        self._outage = time.monotonic()
        since, until = self.outage()  # type: ignore[misc]
        log.warning(
            "etcd at %s unreachable since %s, giving up at %s (retry_timeout %g s)",
            self.endpoints_text(),
            time.strftime("%H:%M:%S", time.localtime(since)),
            time.strftime("%H:%M:%S", time.localtime(until)),
            self.policy.retry_timeout,
        )

    def outage(self) -> tuple[float, float] | None:
        """(since, giving up at), wall-clock seconds, while etcd does not answer; else None.
        Why one deadline per outage, not per call: calls that start late in an outage (the
        next session's, after the lease was lost) would otherwise each retry a whole
        retry_timeout, and "giving up at" would never be true.
        """
        start = self._outage
        if start is None:
            return None
        since = time.time() - (time.monotonic() - start)
        return since, since + self.policy.retry_timeout

    def _within_outage(self, timeout: float | None) -> float:
        """This call's retry budget, cut to what is left of the outage's."""
        budget = self.policy.call_timeout(timeout)
        if self._outage is None:
            return budget
        left = self._outage + self.policy.retry_timeout - time.monotonic()
        return max(0.0, min(budget, left))

    def _closed_or(self, e: ValueError) -> EtcdError:
        if self._closed:
            return EtcdClosedError("etcd client is closed")
        return EtcdError(f"etcd: {e}")

    def call(self, name: str, request: Any, *, timeout: float | None = None) -> Any:
        """One unary RPC by name, with failover, retry and re-login. ``timeout`` bounds the
        whole call (default: the policy's retry_timeout); each attempt gets request_timeout.
        """
        observer = self.observer
        if observer is None:  # the hot path: metrics off
            return self._call(name, request, timeout)
        start = time.perf_counter()
        try:
            resp = self._call(name, request, timeout)
        except EtcdError as e:
            observer(name, time.perf_counter() - start, type(e).__name__)
            raise
        observer(name, time.perf_counter() - start, None)
        return resp

    def _call(self, name: str, request: Any, timeout: float | None) -> Any:
        if self._closed:
            raise EtcdClosedError("etcd client is closed")
        per_request = min(self.policy.request_timeout, self.policy.call_timeout(timeout))

        def attempt(idx: int) -> Any:
            md = self.metadata() or None  # before the gate: a login is a call of its own
            with GATE.call():
                return bind(self.channel(idx), name)(request, timeout=per_request, metadata=md)

        try:
            return self._retrying(attempt, timeout)
        except EtcdTokenExpiredError:
            if self.config.user is None:
                raise
            self.login(self._token)
            return self._retrying(attempt, timeout)

    def call_on(self, index: int, name: str, request: Any, timeout: float | None = None) -> Any:
        """One unary RPC on one endpoint, no failover (Status of a given member)."""
        md = self.metadata() or None
        try:
            with GATE.call():
                return bind(self.channel(index), name)(
                    request, timeout=timeout or self.policy.request_timeout, metadata=md
                )
        except grpc.RpcError as e:
            raise from_rpc_error(e, str(self.endpoint(index))) from None

    def stream(self, name: str, requests: Iterator, index: int, timeout: float | None = None):
        """Open a bidirectional stream on endpoint ``index`` (the caller handles failover, and
        holds ``forks.GATE.call()`` from here until the stream has ended).
        """
        return bind(self.channel(index), name)(
            requests, timeout=timeout, metadata=self.metadata(streaming=True)
        )

    def on_stream_error(self, exc: BaseException, index: int) -> EtcdError:
        """Book-keeping for a failed stream: fail over or re-login; return the typed error."""
        if isinstance(exc, grpc.RpcError):
            if is_token_expired(exc) and self.config.user is not None:
                try:
                    self.login(self._token)
                except EtcdError as e:
                    return e
            elif is_transient(exc) or exc.code() == grpc.StatusCode.CANCELLED:
                self.fail_over(index)
                if is_transient(exc):  # a keep-alive or a watch met the outage first
                    self._outage_begins()
            return from_rpc_error(exc, str(self.endpoint(index)))
        return exc if isinstance(exc, EtcdError) else EtcdError(str(exc))

    def endpoints_text(self) -> str:
        return ",".join(str(ep) for ep in self.config.endpoints)

    def close(self) -> None:
        self._check_fork()
        with self._lock:
            self._closed = True
            channels, self._channels = self._channels, {}
        for ch in channels.values():
            ch.close()
