"""Leases and the one thread per client that keeps them alive.

Why the client knows when a lease is lost before etcd does: fencing. A lease lives on the server
at least until ``sent + TTL``, where ``sent`` is when we sent the keep-alive etcd acknowledged
(etcd refreshes on receipt, which is later). So when no keep-alive has been acknowledged for
``TTL - margin``, we declare the lease lost *before* it can expire: the owner stops its workers
while its keys still exist, and no two live agents ever hold the same place.

Why a lease is first *in doubt*, and lost only later: an etcd leader election can outlast the
margin (bench/results.md, 'Design notes' figures', S4), and declaring the lease lost then would
fence every agent although etcd renews every lease when a new leader takes over. So at
``presumed_lost_at`` the lease is only in doubt (``in_doubt`` set, ``on_doubt`` callbacks: the
agent pauses its workers, SIGSTOP — a stopped process does not talk), keep-alives go on, and an
answer with TTL > 0 clears the doubt (the workers resume); it is *lost* once etcd could have
expired it (``expires_no_earlier_than``, TTL after the last acknowledged keep-alive's send time)
or answers TTL <= 0.

Why one short stream per keep-alive tick rather than one long-lived stream: a tick is a complete
request/answer with its own deadline and endpoint, so failover, deadlines and re-login work
exactly as for unary calls, and a half-dead stream can never silently stall the keep-alives.
"""

from __future__ import annotations  # noqa: I001 - _grpc_quiet first

from etcdrun.rendezvous.client import _grpc_quiet  # noqa: F401 - GRPC_VERBOSITY, before grpc

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import grpc

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client.forks import GATE
from etcdrun.rendezvous.client.transport import Transport

log = logging.getLogger(__name__)


def fence_margin(ttl: float) -> float:
    """How long before the earliest possible expiry we give up on a lease: enough to stop
    workers, but small enough that a short etcd blip (leader change) is ridden out.
    """
    return min(max(0.2 * ttl, 0.5), ttl / 2)


class LeaseLoss(enum.Enum):
    """How a lease was lost, for code to decide on (``Lease.lost_reason`` is the line for
    people, with its details). Only REVOKED is this process's own doing: its agent left.
    """

    REVOKED = "revoked"  # revoke(): this process gave it back
    ABANDONED = "abandoned"  # abandon(): its owner learnt it has no place left
    GONE = "gone"  # confirm(): etcd no longer knows it (revoked or expired there)
    EXPIRED = "expired"  # a keep-alive's answer: TTL 0
    UNANSWERED = "unanswered"  # no keep-alive acknowledged for its TTL: presumed lost


class Lease:
    """A granted lease. ``lost`` is set once it expired, was revoked, or etcd could have expired it.

    Connection loss: keep-alives are retried across endpoints; ``TTL - margin`` after the send
    time of the last acknowledged one it is ``in_doubt`` (until an answer), at ``TTL`` after it
    ``lost`` is set and the callbacks run (on the keeper thread; keep them short). A lost lease
    never comes back: the owner grants a new one.
    """

    def __init__(
        self, keeper: LeaseKeeper | None, lease_id: int, ttl: int, sent_at: float, interval: float
    ):
        self.id = lease_id
        self.ttl = ttl
        self.lost = threading.Event()
        self.lost_reason = ""  # the line for people
        self.lost_how: LeaseLoss | None = None  # what code decides on
        self._keeper = keeper
        self._callbacks: list[Callable[[Lease], None]] = []
        self._refreshed: list[Callable[[Lease], None]] = []
        self._doubted: list[Callable[[Lease], None]] = []
        self.in_doubt = threading.Event()  # past presumed_lost_at, unanswered, not yet lost
        self._acked_sent_at = sent_at
        self._interval = interval
        self._next_at = sent_at + interval
        self._failures = 0  # keep-alive ticks failed in a row
        self._revoked = False
        self._orphaned = False
        self._abandoned = False
        self._presumed = False  # lost for want of an answer, not known gone on the server
        self.keepalives = 0

    @property
    def expires_no_earlier_than(self) -> float:
        """Monotonic time before which etcd cannot have expired the lease."""
        return self._acked_sent_at + self.ttl

    @property
    def presumed_lost_at(self) -> float:
        return self.expires_no_earlier_than - fence_margin(self.ttl)

    def on_refreshed(self, callback: Callable[[Lease], None]) -> None:
        """Run ``callback(lease)`` after every acknowledged keep-alive (on the keeper thread;
        keep it short): ``presumed_lost_at`` has moved.
        """
        self._refreshed.append(callback)

    def on_doubt(self, callback: Callable[[Lease], None]) -> None:
        """Run ``callback(lease)`` each time the lease falls in doubt (keeper thread)."""
        self._doubted.append(callback)

    @property
    def next_deadline(self) -> float:
        """When the keeper must look again without an answer: doubt, then loss."""
        return self.expires_no_earlier_than if self.in_doubt.is_set() else self.presumed_lost_at

    def _run_callbacks(self, callbacks: list[Callable[[Lease], None]]) -> None:
        for cb in list(callbacks):
            try:
                cb(self)
            except Exception:  # a listener must not stop the keep-alives
                log.exception("lease callback failed")

    def on_lost(self, callback: Callable[[Lease], None]) -> None:
        """Run ``callback(lease)`` once when the lease is lost (at once if it already is)."""
        self._callbacks.append(callback)
        if self.lost.is_set():
            callback(self)

    def _mark_lost(self, how: LeaseLoss, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lost_how, self.lost_reason = how, reason
        self.lost.set()
        if not self._revoked:  # the owner says what it means (the agent: "fenced: ..."); here
            log.info("etcd lease %x lost: %s", self.id, reason)  # for agent.log, not the console
        for cb in list(self._callbacks):
            try:
                cb(self)
            except Exception:  # a callback must not kill the keeper thread
                log.exception("lease-lost callback failed")

    def confirm(self, timeout: float) -> bool | None:
        """Ask etcd now whether the lease still lives (LeaseTimeToLive, one bounded call):
        False — and ``lost`` set — when it is gone (revoked by someone else, expired); None
        when etcd did not answer in time (the keep-alives go on deciding). Why: a round
        superseded because our own lease vanished must be fenced at once, not stopped with a
        grace, and the next keep-alive could be TTL/3 away.
        """
        from etcdrun.rendezvous.client.errors import EtcdError, EtcdLeaseNotFoundError

        if self._keeper is None or self.lost.is_set():
            return not self.lost.is_set()
        try:
            req = pb.LeaseTimeToLiveRequest(ID=self.id)
            if self._keeper._t.call("LeaseTimeToLive", req, timeout=timeout).TTL > 0:
                return True
        except EtcdLeaseNotFoundError:
            pass
        except EtcdError:
            return None
        self._keeper.forget(self)
        self._mark_lost(LeaseLoss.GONE, "gone on the server (revoked or expired)")
        return False

    def abandon(self, reason: str) -> None:
        """Give the lease up now, though etcd still holds it (its owner learnt it has no place
        left: its agent key was removed): ``lost`` is set with ``reason`` and the callbacks run
        — the workers are fenced — and keep-alives stop; ``revoke()`` afterwards still revokes
        it on the server, so its join records go at once. Safe on the watch thread: no call.
        """
        self._abandoned = True
        if self._keeper is not None:
            self._keeper.forget(self)
        self._mark_lost(LeaseLoss.ABANDONED, reason)

    def orphan(self) -> None:
        """Stop keeping it alive, and forget it, without revoking: on the server it expires
        after its TTL, exactly as if this process had died (etcd's Session.Orphan). Nothing is
        reported locally (``lost`` stays as it was), and ``revoke()`` afterwards does nothing.
        For tests that play a crash, and for handing a lease over to another process.
        """
        self._orphaned = True
        if self._keeper is not None:
            self._keeper.forget(self)

    def revoke(self, timeout: float | None = None) -> bool:
        """Revoke on the server (its keys vanish at once) and stop keeping it alive. Idempotent;
        True when etcd confirmed (or the lease was already gone). ``timeout`` defaults to the
        policy's parting timeout: a leave must not hang on a dead etcd.
        """
        if self._keeper is None or self._orphaned:
            return True
        self._keeper.forget(self)
        was_lost = self.lost.is_set()
        self._revoked = True
        self._mark_lost(LeaseLoss.REVOKED, "revoked")
        if was_lost and self._presumed:  # etcd did not answer: revoke when it next does
            self._keeper.revoke_later(self.id)
            return True  # nothing of this node's left to wait for here
        if was_lost and self.lost_how is not LeaseLoss.REVOKED and not self._abandoned:
            return True  # gone on the server already
        return self._keeper.revoke(self.id, timeout)

    def __repr__(self) -> str:
        return f"Lease(id={self.id:x}, ttl={self.ttl}, lost={self.lost.is_set()})"


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
    transport: Transport, ids: list[int], index: int, timeout: float, acked: dict[int, int]
) -> None:
    """One keep-alive stream on endpoint ``index``: a request per lease id, their answers (TTL)
    into ``acked`` as they come; raises grpc.RpcError when the stream fails (``acked`` keeps
    what came before).
    """
    call = transport.stream(
        "LeaseKeepAlive",
        iter([pb.LeaseKeepAliveRequest(ID=i) for i in ids]),
        index,
        timeout=timeout,
    )
    for resp in call:
        acked[resp.ID] = resp.TTL
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
        try:
            if self._relay is not None:
                acked.update(self._relay([ls.id for ls in due], timeout))
            else:
                with GATE.call():  # a fork waits for the tick (bounded by its timeout)
                    send_keepalives(self._t, [ls.id for ls in due], idx, timeout, acked)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED or len(acked) < len(due):
                self._t.on_stream_error(e, idx)
                log.debug("lease keep-alive on %s failed: %s", self._t.endpoint(idx), e.code())
        except Exception as e:  # closed channel, fork, ...
            log.debug("lease keep-alive failed: %r", e)
        self._settle(due, acked, sent)

    def _settle(self, due: list[Lease], acked: dict[int, int], sent: float) -> None:
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
