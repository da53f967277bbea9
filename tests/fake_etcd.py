"""An in-memory etcd v3 with the EtcdClient surface the rendezvous uses, for unit tests.

Why: the leader and the driver are tested the way ``decide()`` is — many small worlds, fast,
deterministic — which a real etcd cannot give (its timing is the test's). Everything that is a
rule of etcd and that our code relies on is kept: one revision per write transaction, create and
mod revisions and versions, leases that take their keys with them in one revision, compares over
a range (all keys must match; an empty range compares as a zero KeyValue, except VALUE), watches
that replay history from a start revision and get one batch per transaction. What a real etcd
adds (raft, failover, compaction, auth) is tested against real etcd elsewhere.

``deliver="manual"`` queues watch batches until ``pump()``, so a test sees each step; the
default delivers them right after the write that made them, on the writer's thread — but always
in commit order, one thread at a time, as etcd's single watch stream does (two writers racing
must never hand a watcher revision 11 before revision 10).
``fail_next(method, error)`` makes the next call of a method raise, as a dead etcd would.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import (
    EtcdLeaseNotFoundError,
    LeaseLoss,
    RangeResult,
    RetryPolicy,
    TxnResult,
    WatchBatch,
)
from etcdrun.rendezvous.client import txn as t


class FakeLease:
    def __init__(self, etcd: FakeEtcd, lease_id: int, ttl: int) -> None:
        self.id, self.ttl = lease_id, ttl
        self.lost = threading.Event()
        self.lost_reason = ""
        self.lost_how: LeaseLoss | None = None
        self.in_doubt = threading.Event()  # never set: keep-alives are never unanswered
        self.keys: set[bytes] = set()
        self._etcd = etcd
        self._callbacks: list[Callable[[FakeLease], None]] = []
        self.orphaned = False
        self.term = 1  # one leader forever: the term never changes

    @property
    def presumed_lost_at(self) -> float:
        return float("inf")  # an in-memory lease is never in doubt

    def on_refreshed(self, callback: Callable[[FakeLease], None]) -> None:
        pass  # never refreshed: it never expires unless a test says so

    def on_doubt(self, callback: Callable[[FakeLease], None]) -> None:
        pass

    def on_lost(self, callback: Callable[[FakeLease], None]) -> None:
        self._callbacks.append(callback)
        if self.lost.is_set():
            callback(self)

    def mark_lost(self, how: LeaseLoss, reason: str) -> None:
        if self.lost.is_set():
            return
        self.lost_how, self.lost_reason = how, reason
        self.lost.set()
        for cb in list(self._callbacks):
            cb(self)

    def abandon(self, reason: str) -> None:
        self.mark_lost(LeaseLoss.ABANDONED, reason)

    def confirm(self, timeout: float) -> bool:
        return not self.lost.is_set()

    def orphan(self) -> None:
        self.orphaned = True

    def revoke(self, timeout: float | None = None) -> bool:
        if self.orphaned:
            return True
        self._etcd.drop_lease(self.id, LeaseLoss.REVOKED, "revoked")
        return True


class FakeWatch:
    def __init__(self, etcd: FakeEtcd, key: bytes, end: bytes, callback: Callable) -> None:
        self.key, self.end, self.callback = key, end, callback
        self.cancelled = False
        self._etcd = etcd

    def matches(self, key: bytes) -> bool:
        return self._etcd.in_range(key, self.key, self.end)

    def cancel(self) -> None:
        self.cancelled = True


class FakeEtcd:
    def __init__(self, *, deliver: str = "sync", policy: RetryPolicy | None = None) -> None:
        self.policy = policy or RetryPolicy()
        self.revision = 1
        self.kvs: dict[bytes, pb.KeyValue] = {}
        self.leases: dict[int, FakeLease] = {}
        self.history: list[tuple[int, pb.Event]] = []
        self.watches: list[FakeWatch] = []
        self.writes = 0  # write transactions applied (a raft proposal each, in a real etcd)
        self._manual = deliver == "manual"
        self._queue: deque[tuple[FakeWatch, WatchBatch]] = deque()  # in commit order
        self._draining = threading.Lock()
        self._faults: dict[str, list[Exception | None]] = {}
        self.timeouts: list[tuple[str, float | None]] = []  # (method, timeout=) of each call
        self._lock = threading.RLock()
        self._next_lease = 0x1000

    # ---- test controls -------------------------------------------------------------------------
    def fail_next(self, method: str, error: Exception, times: int = 1, skip: int = 0) -> None:
        """Make calls of ``method`` raise ``error``: ``times`` of them, after ``skip`` more."""
        self._faults.setdefault(method, []).extend([None] * skip + [error] * times)

    def pump(self) -> int:
        """Deliver every queued watch batch (manual mode); return how many."""
        n = 0
        while self._queue:
            with self._lock:
                w, batch = self._queue.popleft()
            if not w.cancelled:
                w.callback(batch)
                n += 1
        return n

    def expire(self, lease_id: int) -> None:
        """The lease's TTL passed on the server: its keys go, its holder learns it."""
        self.drop_lease(lease_id, LeaseLoss.EXPIRED, "expired on the server")

    def live_leases(self) -> list[int]:
        with self._lock:
            return sorted(self.leases)

    # ---- the EtcdClient surface ------------------------------------------------------------------
    def range(
        self,
        key,
        range_end=None,
        *,
        prefix=False,
        limit=0,
        keys_only=False,
        count_only=False,
        sort=None,
        max_create_revision=0,
        min_create_revision=0,
        timeout=None,
        **_kw,
    ):
        self._fault("range")
        self.timeouts.append(("range", timeout))
        with self._lock:
            req = pb.RangeRequest(
                key=t.to_bytes(key),
                range_end=t.range_end(key, prefix, range_end),
                limit=limit,
                keys_only=keys_only,
                count_only=count_only,
                max_create_revision=max_create_revision,
                min_create_revision=min_create_revision,
            )
            if sort:
                req.sort_target = pb.RangeRequest.SortTarget.Value(sort[0].upper())
                req.sort_order = pb.RangeRequest.SortOrder.Value(sort[1].upper())
            resp = self._range(req)
            return RangeResult(list(resp.kvs), self.revision, resp.count, resp.more)

    def get(self, key, **kw) -> pb.KeyValue | None:
        kvs = self.range(key, **kw).kvs
        return kvs[0] if kvs else None

    def get_prefix(self, prefix, **kw) -> RangeResult:
        return self.range(prefix, prefix=True, **kw)

    def put(self, key, value, lease=0, timeout=None) -> int:
        lid = getattr(lease, "id", lease)
        op = t.put(key, t.to_bytes(value), lid)
        return self.txn([], [op]).revision

    def delete(self, key, *, prefix=False, range_end=None, timeout=None) -> int:
        res = self.txn([], [t.delete(key, prefix, range_end)])
        return res.responses[0].response_delete_range.deleted

    def txn(self, compare: Sequence[pb.Compare], success=(), failure=(), timeout=None):
        self._fault("txn")
        self.timeouts.append(("txn", timeout))
        with self._lock:
            ok = all(self._compare_ok(c) for c in compare)
            ops = list(success if ok else failure)
            writes = [op for op in ops if not op.HasField("request_range")]
            rev = self.revision + 1 if writes else self.revision
            events: list[pb.Event] = []
            responses = [self._apply(op, rev, events) for op in ops]
            if writes:
                self.revision, self.writes = rev, self.writes + 1
            batches = self._batches(events, rev)
            seen = self.revision  # the txn's own revision: read under the lock, as etcd's header
        self._deliver(batches)
        return TxnResult(ok, responses, seen)

    def lease(self, ttl: int, keepalive: bool = True) -> FakeLease:
        self._fault("lease")
        with self._lock:
            self._next_lease += 1
            lease = FakeLease(self, self._next_lease, int(ttl))
            self.leases[lease.id] = lease
            return lease

    def watch(
        self, key, *, prefix=False, range_end=None, start_revision=0, prev_kv=False, callback=None
    ) -> FakeWatch:
        self._fault("watch")
        with self._lock:
            w = FakeWatch(self, t.to_bytes(key), t.range_end(key, prefix, range_end), callback)
            self.watches.append(w)
            old = [ev for rev, ev in self.history if rev >= start_revision > 0]
            batches = self._batches([ev for ev in old if w.matches(ev.kv.key)], 0, only=w)
        self._deliver(batches)
        return w

    def keep_alive(self, lease_id: int) -> FakeLease:
        with self._lock:
            lease = self.leases.get(lease_id)
        if lease is None:
            raise EtcdLeaseNotFoundError(f"etcd lease {lease_id:x} has expired")
        lease.orphaned = False
        return lease

    def revoke(self, lease_id: int, timeout: float | None = None) -> bool:
        self.drop_lease(lease_id, LeaseLoss.REVOKED, "revoked")
        return True

    def close(self, revoke_leases: bool = True) -> None:
        pass

    @property
    def reached(self) -> bool:
        return True  # an in-memory etcd always answers

    @property
    def endpoints(self) -> str:
        return "fake:2379"

    def outage(self) -> tuple[float, float] | None:
        return None  # never unreachable

    def status(self) -> pb.StatusResponse:
        return pb.StatusResponse(version="fake")

    # ---- etcd's rules ------------------------------------------------------------------------
    @staticmethod
    def in_range(k: bytes, key: bytes, end: bytes) -> bool:
        if not end:
            return k == key
        return k >= key and (end == b"\0" or k < end)

    def _range(self, req: pb.RangeRequest) -> pb.RangeResponse:
        kvs = [kv for k, kv in sorted(self.kvs.items()) if self.in_range(k, req.key, req.range_end)]
        if req.max_create_revision:
            kvs = [kv for kv in kvs if kv.create_revision <= req.max_create_revision]
        if req.min_create_revision:
            kvs = [kv for kv in kvs if kv.create_revision >= req.min_create_revision]
        if req.sort_order:
            field = pb.RangeRequest.SortTarget.Name(req.sort_target).lower()
            attr = {"create": "create_revision", "mod": "mod_revision"}.get(field, field)
            kvs.sort(key=lambda kv: getattr(kv, attr), reverse=req.sort_order == 2)
        count, more = len(kvs), bool(req.limit and len(kvs) > req.limit)
        if req.limit:
            kvs = kvs[: req.limit]
        if req.count_only:
            kvs = []
        elif req.keys_only:
            kvs = [
                pb.KeyValue(
                    key=kv.key,
                    create_revision=kv.create_revision,
                    mod_revision=kv.mod_revision,
                    version=kv.version,
                    lease=kv.lease,
                )
                for kv in kvs
            ]
        return pb.RangeResponse(kvs=kvs, count=count, more=more)

    def _compare_ok(self, c: pb.Compare) -> bool:
        kvs = [kv for k, kv in self.kvs.items() if self.in_range(k, c.key, c.range_end)]
        if not kvs:
            if c.target == pb.Compare.VALUE:
                return False
            kvs = [pb.KeyValue()]
        name = {0: "version", 1: "create_revision", 2: "mod_revision", 3: "value", 4: "lease"}
        field = name[c.target]
        want = getattr(c, field)
        ops = {
            0: lambda a: a == want,
            1: lambda a: a > want,
            2: lambda a: a < want,
            3: lambda a: a != want,
        }
        return all(ops[c.result](getattr(kv, field)) for kv in kvs)

    def _apply(self, op: pb.RequestOp, rev: int, events: list) -> pb.ResponseOp:
        which = op.WhichOneof("request")
        if which == "request_range":
            return pb.ResponseOp(response_range=self._range(op.request_range))
        if which == "request_put":
            self._put(op.request_put, rev, events)
            return pb.ResponseOp(response_put=pb.PutResponse())
        req = op.request_delete_range
        gone = [k for k in self.kvs if self.in_range(k, req.key, req.range_end)]
        for k in sorted(gone):
            self._remove(k, rev, events)
        return pb.ResponseOp(response_delete_range=pb.DeleteRangeResponse(deleted=len(gone)))

    def _put(self, req: pb.PutRequest, rev: int, events: list) -> None:
        if req.lease and req.lease not in self.leases:
            raise EtcdLeaseNotFoundError("etcdserver: requested lease not found")
        old = self.kvs.get(req.key)
        if old is not None and old.lease and old.lease in self.leases:
            self.leases[old.lease].keys.discard(req.key)
        kv = pb.KeyValue(
            key=req.key,
            value=req.value,
            lease=req.lease,
            mod_revision=rev,
            create_revision=old.create_revision if old else rev,
            version=old.version + 1 if old else 1,
        )
        self.kvs[req.key] = kv
        if req.lease:
            self.leases[req.lease].keys.add(req.key)
        events.append(pb.Event(type=pb.Event.PUT, kv=kv))

    def _remove(self, key: bytes, rev: int, events: list) -> None:
        old = self.kvs.pop(key)
        if old.lease in self.leases:
            self.leases[old.lease].keys.discard(key)
        events.append(pb.Event(type=pb.Event.DELETE, kv=pb.KeyValue(key=key, mod_revision=rev)))

    def drop_lease(self, lease_id: int, how: LeaseLoss, reason: str) -> None:
        with self._lock:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                return
            batches = []
            if lease.keys:
                rev, events = self.revision + 1, []
                for k in sorted(lease.keys):
                    self._remove(k, rev, events)
                self.revision, self.writes = rev, self.writes + 1
                batches = self._batches(events, rev)
        self._deliver(batches)
        lease.mark_lost(how, reason)

    def _batches(self, events, rev, only: FakeWatch | None = None):
        if rev:
            self.history.extend((rev, ev) for ev in events)
        out = []
        for w in [only] if only else list(self.watches):
            mine = [ev for ev in events if w.matches(ev.kv.key)]
            if mine and not w.cancelled:
                out.append((w, WatchBatch(w, mine, rev or self.revision)))
        self._queue.extend(out)  # the caller holds the lock: the queue is in commit order
        return out

    def _deliver(self, batches) -> None:
        """Hand batches out in commit order (callers queued them under the lock, in order)."""
        if self._manual:
            return
        while True:
            if not self._draining.acquire(blocking=False):
                return  # whoever drains now delivers ours too, in order
            try:
                while True:
                    with self._lock:
                        if not self._queue:
                            break
                        w, batch = self._queue.popleft()
                    if not w.cancelled:
                        w.callback(batch)
            finally:
                self._draining.release()
            with self._lock:  # a batch queued while we were letting go of the drain
                if not self._queue:
                    return

    def _fault(self, method: str) -> None:
        queue = self._faults.get(method)
        if queue:
            error = queue.pop(0)
            if error is not None:
                raise error
