"""Leader election by create revision (etcd's election recipe), without a herd.

Why: exactly one agent — the oldest live one — watches the joined/ and agents/ prefixes and
freezes rounds (L5: O(N) watch events per round, not O(N^2)). Every other agent watches only the
one agent key just older than its own, from the revision it read + 1; when that key is deleted it
looks again, and either finds a new predecessor or is now the oldest. A death wakes one agent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import EtcdClient, Watch, WatchBatch

log = logging.getLogger(__name__)


class Election:
    """Call ``check()`` at start and whenever ``on_change`` fires; ``is_leader`` tells the rest."""

    def __init__(
        self,
        client: EtcdClient,
        agents_prefix: str,
        my_create_revision: int,
        on_change: Callable[[], None],
    ) -> None:
        self._client = client
        self._prefix = agents_prefix
        self._mine = my_create_revision
        self._on_change = on_change
        self._watch: Watch | None = None
        self.is_leader = False
        self.predecessor: str | None = None

    def check(self) -> bool:
        """Find the predecessor; watch it, or become leader. Returns ``is_leader``."""
        if self.is_leader:
            return True
        res = self._client.range(
            self._prefix,
            prefix=True,
            max_create_revision=self._mine - 1,
            sort=("create", "descend"),
            limit=1,
            keys_only=True,
        )
        self._cancel()
        if not res.kvs:
            self.is_leader = True
            self.predecessor = None
            return True
        key = res.kvs[0].key
        self.predecessor = key.decode()

        def deleted(batch: WatchBatch) -> None:
            if batch.error is not None or any(e.type == pb.Event.DELETE for e in batch.events):
                self._on_change()

        self._watch = self._client.watch(key, start_revision=res.revision + 1, callback=deleted)
        return False

    def _cancel(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def close(self) -> None:
        self._cancel()
        self.is_leader = False
