"""The etcd backend's report port: what it tells people, read from its caches, never from etcd.

Why cached reads only: the agent asks from its status ticker, its health port and its metrics
scrape, on their threads, while the rendezvous may be waiting on etcd; every answer here is an
immutable snapshot (the round view, the leader's published status) and never raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from etcdrun.rendezvous.api import LastCall, ReportPort
from etcdrun.rendezvous.etcd.context import RunContext
from etcdrun.rendezvous.etcd.incarnation import Incarnation
from etcdrun.rendezvous.etcd.leader import last_call
from etcdrun.rendezvous.etcd.leader.status import status_line
from etcdrun.rendezvous.events import EventLog


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


__all__ = ["EtcdReport"]
