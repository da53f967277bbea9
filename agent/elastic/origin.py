"""Where an exception arose: in the group's transport (a membership change, maybe) or in the
script (a failure, at once).

Why not the message text: a script's own error that happens to say "NCCL" or "Broken pipe"
waited up to a lease for a verdict that never came, and a transport error worded otherwise by a
new torch release would be taken for the script's and charged as a failure. So an exception
counts as the transport's only by where it came from:

- ``CollectiveEnded``: a collective waited on through the group's ``InFlight`` (DDP's
  all-reduces, etcdrun's own collectives), failed by a release or by gloo;
- torch's ``DistError`` family (``DistNetworkError``, ``DistBackendError``, ``DistStoreError``):
  torch's own word that the group, its backend or its store failed;
- a collective of the group that failed: every collective issued on the group is seen by a
  post-hook (torch's ``ProcessGroup.register_post_hook``, 2.14), which watches its future. gloo
  raises a peer's closed connection as a plain ``RuntimeError`` and keeps ``get_error()`` at
  SUCCESS, so the failed future is the only sign of it that is not text.

Anything else is the script's own, even when it was raised while a collective failed elsewhere.
The watch costs one future callback per collective. It never touches the group: a hook is
removed with ``close()``.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from etcdrun.elastic.inflight import CollectiveEnded

_ids = itertools.count(0x7E7C)  # hook ids: ours, distinct from a script's small ones


class Failures:
    """One per group a worker uses: ``watch(pg)`` → (``failed``, ``transport``)* → ``close()``.
    Thread-safe: futures complete on the backend's threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failed = 0
        self._pending: list[Any] = []  # futures of collectives not seen to end yet
        self._pg: Any = None
        self._hook_id: int | None = None

    def watch(self, pg: Any) -> None:
        """See every collective issued on ``pg`` from now on."""
        self.close()
        hook_id = next(_ids)
        pg.register_post_hook(hook_id, self._issued)
        with self._lock:
            self._pg, self._hook_id, self._failed, self._pending = pg, hook_id, 0, []

    def close(self) -> None:
        with self._lock:
            pg, hook_id, self._pg, self._hook_id = self._pg, self._hook_id, None, None
        if pg is not None and hook_id is not None:
            try:
                pg.unregister_post_hook(hook_id)
            except RuntimeError:  # an aborted group may refuse; it is dropped anyway
                pass

    @property
    def failed(self) -> int:
        """Failed collectives of the watched group seen so far (one may be counted twice: by
        its callback and here). A collective that has ended but whose callback has not run
        yet (the main thread can see a synchronous collective's error first) is looked at here.
        """
        with self._lock:
            ended = [f for f in self._pending if f.done()]
            self._pending = [f for f in self._pending if not f.done()]
        for fut in ended:
            self._done(fut)
        with self._lock:
            return self._failed

    def transport(self, exc: BaseException) -> bool:
        """Whether ``exc`` arose in the group's transport (see the module docstring)."""
        import torch.distributed as dist

        if isinstance(exc, CollectiveEnded | dist.DistError):
            return True
        return self.failed > 0

    def _issued(self, args: Any) -> None:
        work = args.work
        if work is None:
            return
        fut = work.get_future()
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]
        fut.add_done_callback(self._done)

    def _done(self, fut: Any) -> None:
        try:
            fut.value()
        except Exception:  # noqa: BLE001 - the collective's error: counted, raised elsewhere
            with self._lock:
                self._failed += 1


__all__ = ["Failures"]
