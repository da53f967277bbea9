"""Watches that survive disconnects: one multiplexed stream per client, resumed from the last
revision seen.

Why: a watch is how the rendezvous learns of every membership change without polling, so losing
one silently (as python3-etcd3 does after a reconnect) means a job that never recovers. Each watch
remembers the revision after the last event it delivered; when the stream breaks (member down,
leader lost — we ask for ``hasleader`` — or an etcd restart) the manager reopens it on the next
endpoint and re-creates every watch from that revision: no event lost, none delivered twice.
What cannot be resumed is reported, never swallowed: a compacted start revision becomes
EtcdCompactedError, a permission-denied watch (etcd answers created-then-cancelled inside the
stream) becomes EtcdPermissionError.

Callbacks run on the manager thread: keep them short (hand work to a queue).
"""

from __future__ import annotations  # noqa: I001 - _grpc_quiet first

from etcdrun.rendezvous.client import _grpc_quiet  # noqa: F401 - GRPC_VERBOSITY, before grpc

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import NamedTuple

import grpc

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client.errors import (
    EtcdAuthError,
    EtcdCompactedError,
    EtcdConnectionError,
    EtcdError,
    EtcdPermissionError,
    EtcdTokenExpiredError,
    is_token_expired,
)
from etcdrun.rendezvous.client.forks import GATE
from etcdrun.rendezvous.client.transport import Transport

log = logging.getLogger(__name__)
_STOP = object()


class WatchBatch(NamedTuple):
    """Events of one revision range for one watch, or the error that ended the watch."""

    watch: Watch
    events: list  # of etcd_api_pb2.Event
    revision: int
    error: EtcdError | None = None


class Watch:
    """One key or range. Consume with ``get()``/iteration, or pass ``callback`` to ``watch()``."""

    def __init__(
        self,
        manager: WatchManager,
        wid: int,
        key: bytes,
        range_end: bytes,
        start_revision: int,
        prev_kv: bool,
        callback: Callable[[WatchBatch], None] | None,
    ) -> None:
        self.id = wid
        self.key = key
        self.range_end = range_end
        self.next_revision = start_revision  # 0: "from now" until the first created answer
        self.prev_kv = prev_kv
        self.created = threading.Event()
        self.error: EtcdError | None = None
        self.cancelled = False
        self.relogged = False  # refused once as "permission denied" and logged in again
        self._manager = manager
        self._queue: queue.Queue | None = None if callback else queue.Queue()
        self._callback = callback or self._queue.put  # type: ignore[union-attr]

    def create_request(self) -> pb.WatchRequest:
        return pb.WatchRequest(
            create_request=pb.WatchCreateRequest(
                key=self.key,
                range_end=self.range_end,
                start_revision=self.next_revision,
                prev_kv=self.prev_kv,
                watch_id=self.id,
            )
        )

    def get(self, timeout: float | None = None) -> WatchBatch | None:
        """Next batch, or None on timeout. Raises the error that ended the watch."""
        if self._queue is None:
            raise RuntimeError("this watch delivers to its callback")
        try:
            batch = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if batch.error is not None:
            raise batch.error
        return batch

    def __iter__(self) -> Iterator:
        """Yield events until the watch is cancelled; raise the error that ended it."""
        while not self.cancelled:
            batch = self.get(timeout=0.5)
            if batch is not None:
                yield from batch.events

    def cancel(self) -> None:
        """Stop receiving events. Idempotent."""
        self._manager.cancel(self)

    def _deliver(self, batch: WatchBatch) -> None:
        try:
            self._callback(batch)
        except Exception:
            log.exception("watch callback failed")


class WatchManager:
    """Owns the client's watch stream and its thread (alive only while watches exist)."""

    def __init__(self, transport: Transport) -> None:
        self._t = transport
        self._lock = threading.Lock()
        self._watches: dict[int, Watch] = {}
        self._next_id = 1
        self._thread: threading.Thread | None = None
        self._requests: queue.Queue | None = None
        self._call = None
        self._closing = False
        self._pending: deque[int] = deque()  # creates sent on this stream, not yet answered
        self._closed_event = threading.Event()  # cuts a reconnect backoff short at close
        self.reconnects = 0

    def watch(
        self,
        key: bytes,
        range_end: bytes = b"",
        start_revision: int = 0,
        prev_kv: bool = False,
        callback: Callable[[WatchBatch], None] | None = None,
    ) -> Watch:
        with self._lock:
            if self._closing:
                raise EtcdError("etcd client is closed")
            w = Watch(self, self._next_id, key, range_end, start_revision, prev_kv, callback)
            self._next_id += 1
            self._watches[w.id] = w
            if self._requests is not None:
                self._pending.append(w.id)
                self._requests.put(w.create_request())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="etcd-watch", daemon=True)
                self._thread.start()
        return w

    def cancel(self, w: Watch) -> None:
        with self._lock:
            if w.cancelled:
                return
            w.cancelled = True
            if self._watches.pop(w.id, None) is not None and self._requests is not None:
                self._requests.put(
                    pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=w.id))
                )
            if not self._watches and self._call is not None:
                self._call.cancel()  # the thread sees no watch left and exits

    def _end(self, w: Watch, error: EtcdError) -> None:
        with self._lock:
            self._watches.pop(w.id, None)
            w.cancelled = True
        w.error = error
        w.created.set()
        w._deliver(WatchBatch(w, [], w.next_revision, error))

    # ---- the stream thread ---------------------------------------------------------------
    def _requests_iter(self, q: queue.Queue) -> Iterator:
        while True:
            item = q.get()
            if item is _STOP:
                return
            yield item

    def _run(self) -> None:
        failures = 0  # streams broken in a row: the policy's backoff index
        while True:
            with self._lock:
                if self._closing or not self._watches:
                    self._thread = None
                    return
                idx = self._t.preferred()
                q: queue.Queue = queue.Queue()
                self._pending.clear()
                for w in self._watches.values():
                    self._pending.append(w.id)
                    q.put(w.create_request())
                self._requests = q
            err, delivered, forked = self._stream(q, idx)
            with self._lock:
                if self._closing or not self._watches or forked:
                    continue  # forked: cancelled for a fork, reopened once it is done
            failures = 1 if delivered else failures + 1
            if not self._recoverable(err, idx):
                continue
            self.reconnects += 1
            self._closed_event.wait(self._t.policy.backoff(failures))

    def _stream(self, q: queue.Queue, idx: int) -> tuple[BaseException, bool, bool]:
        """Run one stream until it breaks; (why it broke, whether it delivered anything,
        whether a fork cancelled it).
        """
        delivered = False
        call = None
        try:
            with GATE.call():  # a fork cancels the stream, then waits for it to end
                call = self._t.stream("Watch", self._requests_iter(q), idx)
                with self._lock:
                    self._call = call
                    if not self._watches or self._closing:
                        call.cancel()
                with GATE.stream(call):
                    for resp in self._answers(call):
                        delivered = True
                        self._handle(resp)
            err: BaseException = EtcdConnectionError("watch stream ended by the server")
        except Exception as e:  # grpc.RpcError; a closed channel (ValueError); a fork
            err = e
        finally:
            q.put(_STOP)  # ends grpc's request-consumer thread
            with self._lock:
                self._requests = None
                self._call = None
        return err, delivered, call is not None and GATE.cancelled_for_fork(call)

    def _answers(self, call) -> Iterator[pb.WatchResponse]:
        """The stream's responses; the first one also says that an etcd outage, if one was
        being counted, is over.
        """
        for n, resp in enumerate(call):
            if n == 0:
                self._t.answered_now()
            yield resp

    def _recoverable(self, err: BaseException, idx: int) -> bool:
        """Book-keeping after a broken stream; False when every watch was ended for good (a
        wrong password or a missing permission does not heal by reconnecting).
        """
        if isinstance(err, grpc.RpcError):
            typed = self._t.on_stream_error(err, idx)
        else:
            typed = err if isinstance(err, EtcdError) else EtcdError(f"etcd: {err!r}")
        if isinstance(typed, EtcdTokenExpiredError) and not isinstance(err, grpc.RpcError):
            try:
                self._t.login(stale=self._t.token)
            except EtcdError as e:
                typed = e
        fatal = isinstance(typed, (EtcdAuthError, EtcdPermissionError))
        if fatal and not isinstance(typed, EtcdTokenExpiredError):
            for w in list(self._watches.values()):
                self._end(w, typed)
            return False
        log.debug("watch stream on %s broke (%s); resuming", self._t.endpoint(idx), typed)
        return True

    def _handle(self, resp: pb.WatchResponse) -> None:
        wid = resp.watch_id
        if resp.created:
            # Creates are answered in order. A refused one (permission denied) comes back with
            # watch_id -1 instead of the id we asked for: it belongs to the oldest pending.
            with self._lock:
                if wid in self._pending:
                    self._pending.remove(wid)
                elif wid == -1 and self._pending:
                    wid = self._pending.popleft()
        w = self._watches.get(wid)
        if w is None:
            return  # cancelled by us, or a progress notification for all watches
        if resp.created:
            if resp.canceled and is_token_expired(Exception(resp.cancel_reason)):
                raise EtcdTokenExpiredError(f"etcd: {resp.cancel_reason}")  # re-login, reopen
            if (
                resp.canceled
                and "permission denied" in resp.cancel_reason
                and self._t.config.user is not None
                and not w.relogged
            ):
                # etcd 3.5 refuses a watch with an expired token as "permission denied": log
                # in again once before believing it.
                w.relogged = True
                raise EtcdTokenExpiredError(f"etcd: {resp.cancel_reason}")
            if resp.canceled:
                reason = resp.cancel_reason or "watch refused"
                kind = EtcdPermissionError if "permission denied" in reason else EtcdError
                self._end(w, kind(f"etcd: watch on {w.key!r} refused: {reason}"))
                return
            if w.next_revision == 0:
                w.next_revision = resp.header.revision + 1
            w.relogged = False
            w.created.set()
        if resp.canceled:
            if resp.compact_revision:
                self._end(
                    w,
                    EtcdCompactedError(
                        f"etcd: watch on {w.key!r} from revision {w.next_revision} is compacted "
                        f"(oldest revision left: {resp.compact_revision})",
                        compact_revision=resp.compact_revision,
                    ),
                )
            elif not w.cancelled:
                reason = resp.cancel_reason or "no reason given"
                kind = EtcdPermissionError if "permission denied" in reason else EtcdError
                self._end(w, kind(f"etcd: watch on {w.key!r} cancelled: {reason}"))
            return
        if resp.events:
            w.next_revision = resp.events[-1].kv.mod_revision + 1
            w._deliver(WatchBatch(w, list(resp.events), resp.header.revision))
        elif not resp.created and resp.header.revision >= w.next_revision:
            w.next_revision = resp.header.revision + 1  # progress notification

    def close(self) -> None:
        self._closed_event.set()
        with self._lock:
            self._closing = True
            watches = list(self._watches.values())
            self._watches.clear()
            for w in watches:
                w.cancelled = True
            if self._call is not None:
                self._call.cancel()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._t.policy.thread_stop_timeout)
