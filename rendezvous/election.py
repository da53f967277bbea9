"""Leader election by create revision (etcd's election recipe), without a herd.

Why: exactly one agent — the oldest live one — watches the joined/ and agents/ prefixes and
freezes rounds (L5: O(N) watch events per round, not O(N^2)). Every other agent watches only the
one agent key just older than its own, from the revision it read + 1; when that key is deleted it
looks again, and either finds a new predecessor or is now the oldest. A death wakes one agent.

The election borrows the session (its key is the candidacy, its create revision the place in
line); it writes nothing. Connection loss: a watch that ends in error counts as a change, so the
owner calls ``check()`` again and reads the line afresh.
"""

from __future__ import annotations

from collections.abc import Callable

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import Watch, WatchBatch
from etcdrun.rendezvous.session import Session


class Election:
    """Call ``check()`` at start and whenever ``on_change`` fires; ``is_leader`` tells the rest.

    ``on_change`` runs on the client's watch thread: it must only post work elsewhere."""

    def __init__(self, session: Session, prefix: str, on_change: Callable[[], None]) -> None:
        self._session = session
        self._prefix = prefix
        self._on_change = on_change
        self._watch: Watch | None = None
        self.is_leader = False

    def check(self) -> bool:
        """Find the predecessor; watch it, or become leader. Returns ``is_leader``."""
        if self.is_leader:
            return True
        res = self._session.client.range(
            self._prefix,
            prefix=True,
            max_create_revision=self._session.create_revision - 1,
            sort=("create", "descend"),
            limit=1,
            keys_only=True,
        )
        self._cancel()
        if not res.kvs:
            self.is_leader = True
            return True

        def deleted(batch: WatchBatch) -> None:
            if batch.error is not None or any(e.type == pb.Event.DELETE for e in batch.events):
                self._on_change()

        self._watch = self._session.client.watch(
            res.kvs[0].key, start_revision=res.revision + 1, callback=deleted
        )
        return False

    def _cancel(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        """Stop watching; a later ``check()`` runs the election again. Idempotent."""
        self._cancel()
        self.is_leader = False


__all__ = ["Election"]
