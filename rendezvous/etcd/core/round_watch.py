"""RoundWatch: feeds a RoundView from the round key — read it once, then watch from the next
revision — and nothing else.

Why the round key alone: every agent watches it, so it must be the one key it depends on (L5:
one event per agent per round change, not N). Watch callbacks run on the client's single watch
thread and must return at once, so the watch only updates the view and tells its owner; an ended
watch (compacted history, a refusal) is also only reported — the owner calls ``restart()`` from
its own thread, which re-reads the key and watches again from there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.client import Watch, WatchBatch
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.context import RunContext

log = logging.getLogger(__name__)


class RoundWatch:
    """``on_change`` after each batch applied to the view; ``on_end`` when the watch ended."""

    def __init__(
        self, ctx: RunContext, *, on_change: Callable[[], None], on_end: Callable[[], None]
    ) -> None:
        self._client = ctx.client
        self._keys = ctx.keys
        self._view = ctx.view
        self._on_change = on_change
        self._on_end = on_end
        self._watch: Watch | None = None

    def start(self) -> None:
        """Read the round key into the view, then watch it from the revision after the read."""
        res = self._client.range(self._keys.round)
        if res.kvs:
            self._take(res.kvs[0])
        else:
            self._view.deleted()
        self._watch = self._client.watch(
            self._keys.round, start_revision=res.revision + 1, callback=self._on_batch
        )

    def restart(self) -> None:
        self.cancel()
        self.start()

    def cancel(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _on_batch(self, batch: WatchBatch) -> None:
        if batch.error is not None:  # compacted, or refused: the owner re-reads and re-watches
            log.warning("round watch ended (%s); re-reading the round", batch.error)
            self._on_end()
            return
        for ev in batch.events:
            if ev.type == pb.Event.DELETE:  # the closed marker expired, or the run was cleaned up
                self._view.deleted()
            else:
                self._take(ev.kv)
        self._on_change()

    def _take(self, kv: pb.KeyValue) -> None:
        """One version of the key into the view; an unreadable one is said once, loudly, and
        marked (the leader repairs it) — never a silent stop.
        """
        try:
            decoded = codec.round_and_message(kv.key, kv.value, kv.mod_revision, self._keys.run_id)
        except RendezvousError as e:
            log.error("%s; waiting for the leader to repair it", e)
            self._view.corrupt(kv.mod_revision, e.message)
            return
        self._view.apply(*decoded)


__all__ = ["RoundWatch"]
