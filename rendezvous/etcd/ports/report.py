"""The etcd backend's report port: what it tells people, read from its caches, never from etcd.

Why cached reads only: the agent asks from its status ticker, its health port and its metrics
scrape, on their threads, while the rendezvous may be waiting on etcd; every answer here is an
immutable snapshot (the round view, the leader's published status) and never raises.

The one write, ``kept``: a round taken in place, for ``etcdrun status`` on another machine. It
goes out on a thread of its own (the caller is the workers' control channel), under the run
lease like the cooldowns (it ends with the run), and the same transaction deletes the records
older than ``KEPT_RECORDS`` rounds, so a long run's records stay bounded. A lost write loses
only the record: events.jsonl on the node has it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from etcdrun.rendezvous.api import KeptRound, LastCall, ReportPort
from etcdrun.rendezvous.client import EtcdError
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.leader import last_call
from etcdrun.rendezvous.etcd.leader.status import status_line
from etcdrun.rendezvous.etcd.ports.incarnation import Incarnation
from etcdrun.rendezvous.events import EventLog

log = logging.getLogger("etcdrun.rendezvous")
KEPT_RECORDS = 20  # the rounds taken in place that status can show


class EtcdReport(ReportPort):
    """Reads the run context and the handler's current incarnation; owns nothing."""

    def __init__(self, ctx: RunContext, incarnation: Incarnation) -> None:
        self._ctx = ctx
        self._now = incarnation

    def node_id(self) -> str | None:
        return self._now.node_id

    def events(self) -> EventLog:
        return self._ctx.events

    def status(self) -> str:
        ctx, driver = self._ctx, self._now.driver
        outage = ctx.client.outage()
        if outage is not None:  # say it first: the round below is only what was last seen
            since, until = (time.strftime("%H:%M:%S", time.localtime(t)) for t in outage)
            return f"etcd at {ctx.client.endpoints} unreachable since {since}, giving up at {until}"
        if driver is None and not ctx.client.reached:
            return f"connecting to etcd at {ctx.client.endpoints}"
        leader = driver.status if driver is not None else None
        return status_line(ctx.view.current(), leader, ctx.settings, time.monotonic())

    def round_reason(self) -> str:
        return self._ctx.view.reason()

    def last_call(self) -> LastCall | None:
        s = self._ctx.settings
        return last_call.notice(self._ctx.view.message(), s.min_nodes, s.max_nodes)

    def observe(self, hook: Callable[[str, float, str | None], None] | None) -> None:
        self._ctx.client.observe(hook)

    def kept(self, note: KeptRound) -> None:
        current = self._ctx.view.current()
        lease = current.run_lease if current is not None else 0
        threading.Thread(
            target=self._put_kept, args=(note, lease), name="etcdrun-kept", daemon=True
        ).start()

    def _put_kept(self, note: KeptRound, lease: int) -> None:
        keys = self._ctx.keys
        value = json.dumps(asdict(note), separators=(",", ":")).encode()
        older = keys.kept(max(0, note.round - KEPT_RECORDS + 1))
        try:
            self._ctx.client.txn(
                [],
                [
                    t.put(keys.kept(note.round), value, lease),
                    t.delete(keys.kept_rounds, end=older),
                ],
            )
        except EtcdError as e:
            log.warning(
                "run %s round %d: could not record the round as taken in place: %s",
                keys.run_id,
                note.round,
                e,
            )


__all__ = ["EtcdReport"]
