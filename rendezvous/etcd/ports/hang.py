"""The etcd backend's hang port: the round's hang watchdogs meet under ``<run>/hang/``.

Why etcd and not the workers' own store: a hung round is exactly when the workers' store and
collectives cannot be trusted, while every agent already holds a session and a watch on etcd.
Each notice is one small key, written on this node's session lease (a recipe borrows the
Session, never owns a lease): nothing of it outlives the node, and a node that leaves takes its
notices with it. The round's first alarm is a create-if-absent Txn, so two watchdogs that fire
together raise one alarm (HangPort's contract). Nothing here is written while a round runs
well: the watchdog's beats are local (design.md §4b).

Connection loss: a post that fails is logged and dropped; the subscription's watch resumes
from where it broke (the client's watch manager) and delivers what it missed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.rendezvous.api import HangNotice, HangPort
from etcdrun.rendezvous.client import EtcdError
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.client.watch import WatchBatch
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.ports.incarnation import Incarnation

log = logging.getLogger("etcdrun.rendezvous")


class EtcdHang(HangPort):
    """Posts and watches ``<run>/hang/``; reads the handler's current incarnation for the
    lease, owns nothing but its watch.
    """

    def __init__(self, ctx: RunContext, incarnation: Incarnation) -> None:
        super().__init__()
        self._ctx = ctx
        self._now = incarnation
        self._watch = None

    def post(self, notice: HangNotice) -> None:
        session = self._now.session
        if session is None:  # between incarnations: this node is in no round to speak for
            return
        keys = self._ctx.keys
        node = notice.node if notice.kind == "report" else ""
        key = keys.hang(notice.round, notice.kind, node)
        value = json.dumps({"node": notice.node, **notice.body}, separators=(",", ":")).encode()
        try:
            if notice.kind == "alarm":  # the round's first alarm only
                self._ctx.client.txn(
                    [t.create_revision(key, "==", 0)], [t.put(key, value, session.lease_id)]
                )
            else:
                self._ctx.client.put(key, value, session.lease_id)
        except EtcdError as e:
            log.warning("could not post the hang %s of round %d: %s", notice.kind, notice.round, e)

    def subscribe(self, callback: Callable[[HangNotice], None]) -> Callable[[], None]:
        """Also starts the one watch on ``hang/``, from now on (a round's notices that came
        before the agent subscribed belong to rounds it never ran in), at the first call.
        """
        if self._watch is None:
            self._watch = self._ctx.client.watch(
                self._ctx.keys.hangs, prefix=True, callback=self._deliver
            )
        return super().subscribe(callback)

    def close(self) -> None:
        """End the watch (the handler's shutdown)."""
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _deliver(self, batch: WatchBatch) -> None:
        if batch.error is not None:
            log.warning("the hang notices' watch ended: %s", batch.error)
            return
        for ev in batch.events:
            if ev.type != pb.Event.PUT:
                continue
            notice = self._parse(ev.kv.key, ev.kv.value)
            if notice is not None:
                self._receive(notice)

    def _parse(self, key: bytes, value: bytes) -> HangNotice | None:
        parts = key.decode()[len(self._ctx.keys.hangs) :].split("/")
        try:
            body = json.loads(value)
            return HangNotice(parts[1], int(parts[0]), str(body.pop("node")), body)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            log.warning("ignoring a malformed hang notice at %s", key.decode(errors="replace"))
            return None


__all__ = ["EtcdHang"]
