"""EtcdStore: a ``torch.distributed.Store`` on etcd v3, the store of the torchrun plugin.

Why etcd and not a TCPStore on the rank-0 node (torchrun's c10d): that store dies with its host,
and with it the whole job — the single point of failure etcdrun exists to remove. torch's own
``EtcdStore`` speaks only etcd's v2 API, which etcd 3.6 dropped. This one lives in the etcd the
rendezvous already uses, under one prefix per round (``/<prefix>/<run_id>/store/<round>/``).

Why leased: every key is written under the writing node's session lease, so nothing outlives the
run (a node's keys go with its lease; rank 0 also drops older rounds' prefixes when a round
starts). Why watches: ``wait``/``get`` of a missing key read once, then wait on a watch of that
key — never a poll. The watch starts after the last revision this store saw, not after the read:
a key set and removed at once (the last node through torch's exit barrier sets its key and
leaves, revoking its lease) still counts as set for a peer that had not looked yet.

Semantics are torch's (``compare_set`` on a missing key, ``add`` counters as decimal text, blocking
``get``, ``DistStoreError`` on a timeout, timeout 0 = none): tests/pytorch/test_torch_store.py runs
the same operations on torch's HashStore and on this store, and gloo's
``init_process_group(store=...)`` on three processes. An etcd failure is a ``DistNetworkError``.
Calls cost one request each on the short path (set: a Put; get of a present key: a Range; add,
compare_set, append: one Txn, two when the key exists for add/append; multi_get/multi_set: one Txn
per 128 keys, etcd's default ``--max-txn-ops``).

Methods the C++ side calls by their C++ names (``getNumKeys``, ``deleteKey``) are aliased; the
others are the Python names torch's trampoline looks up.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import EtcdClient, EtcdCompactedError, EtcdError, Watch
from etcdrun.rendezvous.client import txn as t

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
_WAKE = 1.0  # seconds: an endless wait wakes this often to see whether its watch was ended

F = TypeVar("F", bound=Callable[..., Any])


def _etcd_errors(fn: F) -> F:
    """An etcd failure becomes torch's DistNetworkError (what a lost TCPStore raises)."""

    @functools.wraps(fn)
    def wrapper(self: EtcdStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except EtcdError as e:
            raise dist.DistNetworkError(f"etcd store {self.prefix}: {e}") from e

    return wrapper  # type: ignore[return-value]


def _bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _value_is(key: bytes, value: bytes) -> pb.Compare:
    return pb.Compare(key=key, result=pb.Compare.EQUAL, target=pb.Compare.VALUE, value=value)


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i : i + MAX_TXN_OPS] for i in range(0, len(items), MAX_TXN_OPS)] or [[]]


class EtcdStore(dist.Store):
    """torch's key-value store API on one etcd prefix; every key under ``lease`` (0: none)."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        lease: int = 0,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        super().__init__()  # the pybind trampoline needs it
        if not prefix.endswith("/"):
            prefix += "/"
        self.client = client
        self.prefix = prefix
        self.lease = lease
        self._root = prefix.encode()
        self._lock = threading.Lock()
        self._seen = 0  # the newest etcd revision any answer to this store carried
        if timeout is not None:
            self.set_timeout(timeout)

    # ---- writes --------------------------------------------------------------------------------
    @_etcd_errors
    def set(self, key: str, value: str | bytes) -> None:
        self._saw(self.client.put(self._key(key), _bytes(value), lease=self.lease))

    @_etcd_errors
    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        pairs = list(zip(keys, values, strict=True))
        for chunk in _chunks(pairs):
            ops = [t.put(self._key(k), _bytes(v), self.lease) for k, v in chunk]
            self._saw(self.client.txn([], ops).revision)

    @_etcd_errors
    def add(self, key: str, amount: int) -> int:
        def step(old: bytes | None) -> bytes:
            try:
                return str((int(old) if old is not None else 0) + int(amount)).encode()
            except ValueError:
                raise ValueError(f"add: the value of {key!r} is not an integer") from None

        return int(self._update(key, step))

    @_etcd_errors
    def append(self, key: str, value: str | bytes) -> None:
        self._update(key, lambda old: (old or b"") + _bytes(value))

    @_etcd_errors
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``desired`` if the value is ``expected`` (or the key is missing and ``expected``
        is empty); return the value now held — for a missing key with another ``expected``,
        ``expected`` itself, as TCPStore and HashStore answer.
        """
        k, exp, des = self._key(key), _bytes(expected), _bytes(desired)
        while True:
            if not exp:
                res = self._txn([t.create_revision(k, "==", 0)], k, des)
                if res.succeeded:
                    return des
                kvs = res.responses[0].response_range.kvs
                if kvs and kvs[0].value:
                    return kvs[0].value
            res = self._txn([_value_is(k, exp)], k, des)
            if res.succeeded:
                return des
            kvs = res.responses[0].response_range.kvs
            if kvs:
                return kvs[0].value
            if exp:
                return exp
            # missing again, with an empty expected value: it was deleted meanwhile; retry

    @_etcd_errors
    def delete_key(self, key: str) -> bool:
        res = self.client.txn([], [t.delete(self._key(key))])
        self._saw(res.revision)
        return res.responses[0].response_delete_range.deleted > 0

    # ---- reads ---------------------------------------------------------------------------------
    @_etcd_errors
    def get(self, key: str) -> bytes:
        """The value, waiting (up to the store's timeout) for the key to be set."""
        return self._wait_for([self._key(key)], self._deadline(None))[self._key(key)]

    @_etcd_errors
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        wanted = [self._key(k) for k in keys]
        found = self._wait_for(wanted, self._deadline(None))
        return [found[k] for k in wanted]

    @_etcd_errors
    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for([self._key(k) for k in keys], self._deadline(timeout))

    @_etcd_errors
    def check(self, keys: Sequence[str]) -> bool:
        wanted = [self._key(k) for k in keys]
        found, _ = self._read(wanted)
        return len(found) == len(set(wanted))

    @_etcd_errors
    def num_keys(self) -> int:
        res = self.client.range(self._root, prefix=True, count_only=True)
        self._saw(res.revision)
        return res.count

    # The C++ names torch's trampoline calls these two by.
    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802
        return self.delete_key(key)

    def clone(self) -> EtcdStore:
        """The same store (prefix, lease, timeout) on the same client."""
        return EtcdStore(self.client, self.prefix, self.lease, self.timeout)

    # ---- internals -----------------------------------------------------------------------------
    def _key(self, key: str | bytes) -> bytes:
        return self._root + _bytes(key)

    def _saw(self, revision: int) -> None:
        with self._lock:
            self._seen = max(self._seen, revision)

    def _deadline(self, timeout: datetime.timedelta | None) -> float | None:
        """A monotonic deadline; None for "no timeout" (torch's kNoTimeout is 0)."""
        span = (timeout if timeout is not None else self.timeout).total_seconds()
        return None if span <= 0 else time.monotonic() + span

    def _txn(self, compare: list[pb.Compare], key: bytes, value: bytes) -> Any:
        res = self.client.txn(compare, [t.put(key, value, self.lease)], [t.get(key)])
        self._saw(res.revision)
        return res

    def _update(self, key: str, step: Callable[[bytes | None], bytes]) -> bytes:
        """Read-modify-write of one key, fenced on its mod_revision (create if missing)."""
        k = self._key(key)
        compare = [t.create_revision(k, "==", 0)]
        new = step(None)
        while True:
            res = self._txn(compare, k, new)
            if res.succeeded:
                return new
            kvs = res.responses[0].response_range.kvs
            if kvs:
                compare, new = [t.mod_revision(k, "==", kvs[0].mod_revision)], step(kvs[0].value)
            else:
                compare, new = [t.create_revision(k, "==", 0)], step(None)

    def _read(self, keys: Sequence[bytes]) -> tuple[dict[bytes, bytes], int]:
        """The values of those of ``keys`` that exist, and the oldest revision read at."""
        if len(keys) == 1:
            res = self.client.range(keys[0])
            self._saw(res.revision)
            return {kv.key: kv.value for kv in res.kvs}, res.revision
        found: dict[bytes, bytes] = {}
        revision = 0
        for chunk in _chunks(list(dict.fromkeys(keys))):
            res = self.client.txn([], [t.get(k) for k in chunk])
            self._saw(res.revision)
            revision = min(revision, res.revision) if revision else res.revision
            for r in res.responses:
                found.update((kv.key, kv.value) for kv in r.response_range.kvs)
        return found, revision

    def _wait_for(self, keys: Sequence[bytes], deadline: float | None) -> dict[bytes, bytes]:
        """Every key's value, once each is set; DistStoreError at ``deadline``."""
        while True:
            with self._lock:
                seen = self._seen
            found, revision = self._read(keys)
            missing = set(keys) - set(found)
            if not missing:
                return found
            start = seen + 1 if 0 < seen < revision else revision + 1
            try:
                found.update(self._watch_for(missing, start, deadline))
                return found
            except EtcdCompactedError:
                continue  # the start revision is gone: read again, watch from now

    def _watch_for(
        self, missing: set[bytes], start: int, deadline: float | None
    ) -> dict[bytes, bytes]:
        """Watch the span of ``missing`` from ``start`` until each key has been put."""
        lo, hi = min(missing), max(missing) + b"\0"
        watch = self.client.watch(lo, range_end=hi, start_revision=start)
        found: dict[bytes, bytes] = {}
        try:
            while missing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise dist.DistStoreError(_timeout_message(missing, self._root))
                batch = _next_batch(watch, _WAKE if left is None else min(left, _WAKE))
                for ev in batch.events if batch is not None else ():
                    if ev.type == pb.Event.PUT and ev.kv.key in missing:
                        missing.discard(ev.kv.key)
                        found[ev.kv.key] = ev.kv.value
                if batch is not None:
                    self._saw(batch.revision)
        finally:
            watch.cancel()
        return found


def _next_batch(watch: Watch, timeout: float) -> Any:
    if watch.cancelled and watch.error is None:
        raise EtcdError("etcd store: the client was closed during a wait")
    return watch.get(timeout=timeout)


def _timeout_message(missing: set[bytes], root: bytes) -> str:
    names = ", ".join(sorted(k[len(root) :].decode(errors="replace") for k in missing))
    return f"Wait timeout: key(s) not set in the etcd store {root.decode()}: {names}"


__all__ = ["MAX_TXN_OPS", "EtcdStore"]
