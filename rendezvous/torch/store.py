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

Queues (``queue_push``/``queue_pop``/``queue_len``) and ``list_keys`` are torch's too: an item
is a key of its own under ``<prefix>`` + 0xff + ``<key>`` + 0xff, after every key of the store
(UTF-8 keys never hold the byte 0xff), so ``num_keys``/``list_keys`` leave queues out as
HashStore does, and ``queue_pop`` takes the item etcd created first. ``wait``/``check`` count a
non-empty queue, as torch says; a push wakes every waiter, not one (each pop stays exclusive).

Methods the C++ side calls by their C++ names (``getNumKeys``, ``deleteKey``) are aliased; the
others are the Python names torch's trampoline looks up. torch 2.13's trampoline forwards no
``list_keys`` and no queue call: through a ``PrefixStore`` those raise torch's "not implemented",
on the EtcdStore itself they work (docs/torch-store.md has the table). Every store lives until
its client closes (``_keep``): C++ may be the only one holding it.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch.distributed as dist

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import EtcdClient, EtcdCompactedError, EtcdError, Watch
from etcdrun.rendezvous.client import txn as t

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
QUEUES = b"\xff"  # after the prefix, before no key: UTF-8 text never holds the byte 0xff
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


def _chunks(items: Sequence[Any], size: int = MAX_TXN_OPS) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)] or [[]]


def _same(key: bytes) -> bytes:
    return key


_KEPT: list[EtcdStore] = []
_KEPT_LOCK = threading.Lock()


def _keep(store: EtcdStore) -> None:
    """Hold ``store`` until its client closes.

    Why: torch's C++ side holds a Python store by its C++ half only. Once the Python object is
    collected, each call through that half finds no Python method and fails ("fn INTERNAL ASSERT
    FAILED ... Not implemented"). A clone that C++ asks for (``PrefixStore.clone()``, a group
    split, ``_test_python_store``) has no Python owner at all, and a store written inline in
    ``PrefixStore("p", EtcdStore(...))`` loses its own at once. A store is of no use once its
    client is closed, so that is when it is let go (checked whenever another store is made).
    """
    with _KEPT_LOCK:
        _KEPT[:] = [s for s in _KEPT if not s.client.closed]
        _KEPT.append(store)


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
        _keep(self)

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
        """Until each key is set or its queue holds an item (torch's wait counts both)."""
        self._wait_for([self._key(k) for k in keys], self._deadline(timeout), queues=True)

    @_etcd_errors
    def check(self, keys: Sequence[str]) -> bool:
        """Whether each key is set or its queue holds an item (as HashStore answers)."""
        wanted = [self._key(k) for k in keys]
        found, _ = self._read(wanted, queues=True)
        return len(found) == len(set(wanted))

    @_etcd_errors
    def num_keys(self) -> int:
        """The keys set, not the queues (HashStore's count)."""
        res = self.client.range(self._root, self._root + QUEUES, count_only=True)
        self._saw(res.revision)
        return res.count

    @_etcd_errors
    def list_keys(self) -> list[str]:
        """Every key set, in etcd's key order; not the queues (HashStore's list)."""
        res = self.client.range(self._root, self._root + QUEUES, keys_only=True)
        self._saw(res.revision)
        return [kv.key[len(self._root) :].decode(errors="replace") for kv in res.kvs]

    def has_extended_api(self) -> bool:
        """append, multi_get and multi_set are ours: torch (through PrefixStore too) may call
        them instead of falling back to its emulation on get/set/compare_set.
        """
        return True

    # ---- queues: one key per item, popped in the order etcd created them ----------------------
    @_etcd_errors
    def queue_push(self, key: str, value: str | bytes) -> None:
        item = self._queue_of(self._key(key)) + uuid.uuid4().hex.encode()
        self._saw(self.client.put(item, _bytes(value), lease=self.lease))

    @_etcd_errors
    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest item, deleted in a Txn fenced on its create_revision so that two poppers
        never get the same one; blocking: waits (store timeout) on a watch of the queue.
        """
        q = self._queue_of(self._key(key))
        deadline = self._deadline(None)
        while True:
            res = self.client.range(q, prefix=True, sort=("create", "ascend"), limit=1)
            self._saw(res.revision)
            if res.kvs:
                kv = res.kvs[0]
                gone = self.client.txn(
                    [t.create_revision(kv.key, "==", kv.create_revision)], [t.delete(kv.key)]
                )
                self._saw(gone.revision)
                if gone.succeeded:
                    return kv.value
                continue  # another popper took it: the next oldest
            if not block:
                raise dist.QueueEmptyError(f"queue is empty: {key} in the etcd store {self.prefix}")
            try:
                self._watch_for({q}, res.revision + 1, deadline, (q, t.prefix_end(q)), lambda k: q)
            except EtcdCompactedError:
                continue

    @_etcd_errors
    def queue_len(self, key: str) -> int:
        res = self.client.range(self._queue_of(self._key(key)), prefix=True, count_only=True)
        self._saw(res.revision)
        return res.count

    # The C++ names torch's trampoline calls these two by.
    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802
        return self.delete_key(key)

    def clone(self) -> EtcdStore:
        """A new store on the same prefix, lease, client and timeout (its own timeout from now
        on, as a TCPStore's clone has): torch makes one per thread or sub-group. It lives until
        the client closes (``_keep``): often only C++ holds it.
        """
        twin = EtcdStore(self.client, self.prefix, self.lease, self.timeout)
        twin._saw(self._seen)
        return twin

    # ---- internals -----------------------------------------------------------------------------
    def _key(self, key: str | bytes) -> bytes:
        return self._root + _bytes(key)

    def _queue_of(self, name: bytes) -> bytes:
        """The prefix of the queue of the key ``name`` (prefix included): after every key."""
        return self._root + QUEUES + name[len(self._root) :] + QUEUES

    def _owner(self, key: bytes) -> bytes:
        """The key a queue item belongs to; any other key is its own."""
        if not key.startswith(self._root + QUEUES):
            return key
        return self._root + key[len(self._root) + 1 : key.rindex(QUEUES)]

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

    def _read(self, keys: Sequence[bytes], queues: bool = False) -> tuple[dict[bytes, bytes], int]:
        """The values of those of ``keys`` that exist, and the oldest revision read at. With
        ``queues``, a key whose queue holds an item counts too (value b""), in the same Txn.
        """
        if len(keys) == 1 and not queues:
            res = self.client.range(keys[0])
            self._saw(res.revision)
            return {kv.key: kv.value for kv in res.kvs}, res.revision
        found: dict[bytes, bytes] = {}
        revision = 0
        for chunk in _chunks(list(dict.fromkeys(keys)), MAX_TXN_OPS // (1 + queues)):
            ops = [t.get(k) for k in chunk]
            if queues:
                ops += [t.get(self._queue_of(k), prefix=True, count_only=True) for k in chunk]
            res = self.client.txn([], ops)
            self._saw(res.revision)
            revision = min(revision, res.revision) if revision else res.revision
            for r in res.responses[: len(chunk)]:
                found.update((kv.key, kv.value) for kv in r.response_range.kvs)
            for k, r in zip(chunk, res.responses[len(chunk) :], strict=False):
                if r.response_range.count:
                    found.setdefault(k, b"")
        return found, revision

    def _wait_for(
        self, keys: Sequence[bytes], deadline: float | None, queues: bool = False
    ) -> dict[bytes, bytes]:
        """Every key's value, once each is set (with ``queues``: or its queue holds an item);
        DistStoreError at ``deadline``.
        """
        while True:
            with self._lock:
                seen = self._seen
            found, revision = self._read(keys, queues)
            missing = set(keys) - set(found)
            if not missing:
                return found
            start = seen + 1 if 0 < seen < revision else revision + 1
            end = t.prefix_end(self._queue_of(max(missing))) if queues else max(missing) + b"\0"
            owner = self._owner if queues else _same
            try:
                found.update(self._watch_for(missing, start, deadline, (min(missing), end), owner))
                return found
            except EtcdCompactedError:
                continue  # the start revision is gone: read again, watch from now

    def _watch_for(
        self,
        missing: set[bytes],
        start: int,
        deadline: float | None,
        span: tuple[bytes, bytes],
        owner: Callable[[bytes], bytes],
    ) -> dict[bytes, bytes]:
        """Watch ``span`` from ``start`` until a put has come for each of ``missing`` (``owner``
        names the one an event's key stands for).
        """
        watch = self.client.watch(span[0], range_end=span[1], start_revision=start)
        found: dict[bytes, bytes] = {}
        try:
            while missing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise dist.DistStoreError(_timeout_message(missing, self._root))
                batch = _next_batch(watch, _WAKE if left is None else min(left, _WAKE))
                for ev in batch.events if batch is not None else ():
                    name = owner(ev.kv.key)
                    if ev.type == pb.Event.PUT and name in missing:
                        missing.discard(name)
                        found[name] = ev.kv.value
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
    def name(key: bytes) -> str:
        rest = key[len(root) :]
        if rest.startswith(QUEUES):
            return f"queue {rest[1:-1].decode(errors='replace')}"
        return rest.decode(errors="replace")

    names = ", ".join(sorted(name(k) for k in missing))
    return f"Wait timeout: key(s) not set in the etcd store {root.decode()}: {names}"


__all__ = ["MAX_TXN_OPS", "QUEUES", "EtcdStore"]
