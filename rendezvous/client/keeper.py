"""The one thread per client that keeps its leases alive (lease.py says what a lease promises).

Why one short stream per keep-alive tick rather than one long-lived stream: a tick is a complete
request/answer with its own deadline and endpoint, so failover, deadlines and re-login work
exactly as for unary calls, and a half-dead stream can never silently stall the keep-alives.
"""

from __future__ import annotations  # noqa: I001 - _grpc_quiet first

from etcdrun.rendezvous.client import _grpc_quiet  # noqa: F401 - GRPC_VERBOSITY, before grpc

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import grpc

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client.forks import GATE
from etcdrun.rendezvous.client.lease import Lease, LeaseLoss
from etcdrun.rendezvous.client.transport import Transport

log = logging.getLogger(__name__)


class KeepAliveStats(NamedTuple):
    """What one client's keeper has done so far. Why: a client keeping many leases (the scale
    bench's simulated nodes) must show it kept up before its figures count; ``late_max`` says how
    far behind it ran, ``sent`` against the leases' due rate how often it renewed.
    """

    leases: int  # kept alive now
    sent: int  # keep-alive requests sent
    acked: int  # answered with TTL > 0
    ticks: int  # keep-alive streams opened
    late_max: float  # most seconds a tick started after its first lease was due (since reset)
    # most time between two answered keep-alives of one lease, in its keep-alive intervals
    # (since reset); and since the last answer, the most among the leases kept now
    gap_max: float
    stale_max: float
    lapsed: int  # leases given up for want of an answer (etcd could have expired them)


def send_keepalives(
    transport: Transport,
    ids: list[int],
    index: int,
    timeout: float,
    acked: dict[int, int],
    terms: dict[int, int] | None = None,
) -> None:
    """One keep-alive stream on endpoint ``index``: a request per lease id, their answers (TTL)
    into ``acked`` as they come, and the raft term each answer was given in into ``terms``;
    raises grpc.RpcError when the stream fails (both keep what came before).
    """
    call = transport.stream(
        "LeaseKeepAlive",
        iter([pb.LeaseKeepAliveRequest(ID=i) for i in ids]),
        index,
        timeout=timeout,
    )
    for resp in call:
        acked[resp.ID] = resp.TTL
        if terms is not None:
            terms[resp.ID] = resp.header.raft_term
        if len(acked) == len(ids):
            call.cancel()
            break


KeepAliveRelay = Callable[[list[int], float], dict[int, int]]
"""``relay(lease_ids, timeout)``: send one keep-alive per id, return ``{id: TTL}`` for those
etcd answered within ``timeout`` seconds (raise or leave out the rest). Why a port: many
simulated nodes in one Python process (bench/rendezvous_scale.py) starve their keeper's
per-message gRPC work of the GIL; a relay in a process of its own sends their keep-alives, at
two pipe messages a batch here. The keeper still decides every lease's fate (fencing: ``sent``
is taken here, before the relay's request can reach etcd), so its owner's contract is unchanged.
"""


class LeaseKeeper:
    """Keeps every lease of one client alive from a single daemon thread (started lazily).
    A tick sends every lease due within the policy's batch window on one stream (or one
    ``relay`` call).
    """

    def __init__(self, transport: Transport, relay: KeepAliveRelay | None = None) -> None:
        self._t = transport
        self._relay = relay
        self._leases: dict[int, Lease] = {}
        self._stale: set[int] = set()  # presumed lost, to revoke when etcd answers again
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._sent = self._acked = self._ticks = self._lapsed = 0
        self._late_max = self._gap_max = 0.0

    def stats(self, reset: bool = False) -> KeepAliveStats:
        """The counters so far; ``reset`` starts a new window for the two maxima."""
        with self._cv:
            now = time.monotonic()
            stale = max(
                ((now - ls._acked_sent_at) / ls._interval for ls in self._leases.values()),
                default=0.0,
            )
            out = KeepAliveStats(
                len(self._leases),
                self._sent,
                self._acked,
                self._ticks,
                self._late_max,
                self._gap_max,
                stale,
                self._lapsed,
            )
            if reset:
                self._late_max = self._gap_max = 0.0
        return out

    def grant(self, ttl: int, keepalive: bool = True) -> Lease:
        sent = time.monotonic()
        resp = self._t.call("LeaseGrant", pb.LeaseGrantRequest(TTL=int(ttl)))
        self._revoke_stale()  # etcd answers again: the leases it could not be told of go now
        granted = int(resp.TTL)
        lease = Lease(self, resp.ID, granted, sent, self._t.policy.keepalive_interval(granted))
        lease.term = resp.header.raft_term
        if keepalive:
            self._keep(lease)
        return lease

    def adopt(self, lease_id: int) -> Lease:
        """Keep alive a lease granted elsewhere (by an earlier holder): etcd lets any client
        refresh any lease. Its expiry is taken from the server, conservatively (the remaining
        TTL counted from before we asked); raises EtcdLeaseNotFoundError when it is gone.
        """
        from etcdrun.rendezvous.client.errors import EtcdLeaseNotFoundError

        sent = time.monotonic()
        resp = self._t.call("LeaseTimeToLive", pb.LeaseTimeToLiveRequest(ID=lease_id))
        if resp.TTL <= 0:
            raise EtcdLeaseNotFoundError(f"etcd lease {lease_id:x} has expired")
        granted = int(resp.grantedTTL) or int(resp.TTL)
        interval = self._t.policy.keepalive_interval(granted)
        lease = Lease(self, lease_id, granted, sent - (granted - int(resp.TTL)), interval)
        lease.term = resp.header.raft_term
        lease._next_at = sent  # refresh it now: it may have gone unrefreshed for a while
        self._keep(lease)
        return lease

    def _keep(self, lease: Lease) -> None:
        with self._cv:
            self._leases[lease.id] = lease
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(
                    target=self._run, name="etcd-lease-keepalive", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def forget(self, lease: Lease) -> None:
        with self._cv:
            self._leases.pop(lease.id, None)
            self._cv.notify_all()

    def revoke_later(self, lease_id: int) -> None:
        """A lease presumed lost while etcd did not answer may still live on the server, and
        with it its keys: an agent key that the others' next round waits for. Revoke it as
        soon as etcd answers again (the next grant), instead of letting it expire a TTL later
        (a restarted etcd renews every lease it restores).
        """
        with self._cv:
            self._stale.add(lease_id)

    def _revoke_stale(self) -> None:
        with self._cv:
            stale, self._stale = self._stale, set()
        for lease_id in stale:
            if not self.revoke(lease_id, self._t.policy.request_timeout):
                with self._cv:
                    self._stale.add(lease_id)

    def revoke(self, lease_id: int, timeout: float | None) -> bool:
        from etcdrun.rendezvous.client.errors import EtcdError, EtcdLeaseNotFoundError

        if timeout is None:
            timeout = self._t.policy.parting_timeout
        try:
            self._t.call("LeaseRevoke", pb.LeaseRevokeRequest(ID=lease_id), timeout=timeout)
            return True
        except EtcdLeaseNotFoundError:
            return True
        except EtcdError as e:
            log.info("etcd lease %x: revoke failed: %s", lease_id, e)  # it expires by itself
            return False

    def time_to_live(self, lease_id: int, timeout: float) -> int:
        """etcd's seconds left on a lease (one bounded LeaseTimeToLive; <= 0: gone)."""
        req = pb.LeaseTimeToLiveRequest(ID=lease_id)
        return int(self._t.call("LeaseTimeToLive", req, timeout=timeout).TTL)

    def leases(self) -> list[Lease]:
        with self._cv:
            return list(self._leases.values())

    # ---- the keeper thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._leases:
                    self._cv.wait()
                if self._stopping:
                    return
                due, wait = self._pick(time.monotonic())
                if not due:
                    self._cv.wait(timeout=wait)
                    continue
            self._tick(due)

    def _pick(self, now: float) -> tuple[list[Lease], float]:
        """The leases to renew now — once the first is due, every one due within the batch
        window goes along — or none and how long to wait. The caller holds the lock.
        """
        first = min(ls._next_at for ls in self._leases.values())
        if first > now:
            return [], first - now
        window = self._t.policy.keepalive_batch_window
        due = [ls for ls in self._leases.values() if ls._next_at <= now + window(ls.ttl)]
        self._late_max = max(self._late_max, now - first)
        self._ticks += 1
        self._sent += len(due)
        return due, 0.0

    def _tick(self, due: list[Lease]) -> None:
        idx = self._t.preferred()
        sent = time.monotonic()
        until_lost = min(ls.next_deadline for ls in due) - sent
        timeout = self._t.policy.keepalive_timeout(min(ls.ttl for ls in due), until_lost)
        acked: dict[int, int] = {}
        terms: dict[int, int] = {}  # the relay tells no terms: its leases keep their last one
        try:
            if self._relay is not None:
                acked.update(self._relay([ls.id for ls in due], timeout))
            else:
                with GATE.call():  # a fork waits for the tick (bounded by its timeout)
                    send_keepalives(self._t, [ls.id for ls in due], idx, timeout, acked, terms)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or len(acked) < len(due):
                self._t.on_stream_error(e, idx)
                log.debug("lease keep-alive on %s failed: %s", self._t.endpoint(idx), e.code())
        except Exception as e:  # closed channel, fork, ...
            log.debug("lease keep-alive failed: %r", e)
        self._settle(due, acked, sent, terms)

    def _settle(
        self, due: list[Lease], acked: dict[int, int], sent: float, terms: dict[int, int]
    ) -> None:
        """Book one tick's answers: refreshed, expired on the server, presumed lost, or retry."""
        now = time.monotonic()
        if acked:
            self._t.answered_now()
        for ls in due:
            ttl = acked.get(ls.id)
            if ttl is not None and ttl <= 0:
                self.forget(ls)
                ls._mark_lost(LeaseLoss.EXPIRED, "expired on the server")
            elif ttl is not None:
                self._acked += 1  # the keeper thread alone writes these counters
                self._gap_max = max(self._gap_max, (sent - ls._acked_sent_at) / ls._interval)
                ls._acked_sent_at = sent
                ls.keepalives += 1
                ls._failures = 0
                ls._next_at = sent + ls._interval
                ls.term = max(ls.term, terms.get(ls.id, 0))
                if ls.in_doubt.is_set():
                    log.info("etcd lease %x: etcd answered again (TTL %d s): alive", ls.id, ttl)
                ls.in_doubt.clear()
                ls._run_callbacks(ls._refreshed)
            elif now >= ls.expires_no_earlier_than:
                self.forget(ls)
                self._lapsed += 1
                ls._presumed = True  # etcd may still hold it: revoke() defers to revoke_later
                waited = now - ls._acked_sent_at
                ls._mark_lost(LeaseLoss.UNANSWERED, f"no keep-alive acknowledged for {waited:.1f}s")
            else:
                if now >= ls.presumed_lost_at and not ls.in_doubt.is_set():
                    ls.in_doubt.set()
                    log.info(  # the fencing's pause, which follows when it matters, is said
                        "etcd lease %x in doubt: no keep-alive acknowledged for %.1fs",
                        ls.id,
                        now - ls._acked_sent_at,
                    )
                    ls._run_callbacks(ls._doubted)
                ls._failures += 1
                ls._next_at = now + self._t.policy.keepalive_retry_in(
                    ls._failures, ls.next_deadline - now
                )

    def close(self, revoke: bool = True) -> None:
        """Stop the thread; revoke what is still kept alive (bounded), so close leaves no lease."""
        with self._cv:
            leases = list(self._leases.values())
            self._stopping = True
            self._cv.notify_all()
        if revoke:
            for ls in leases:
                ls.revoke()
            with self._cv:
                stale, self._stale = self._stale, set()
            for lease_id in stale:  # one attempt each: leaving must not hang on a dead etcd
                self.revoke(lease_id, self._t.policy.parting_timeout)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._t.policy.thread_stop_timeout)
