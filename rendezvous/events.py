"""One structured event per state transition, from one node's log of them.

Why one function: status tools, metrics and tests all want the same facts (round opened, frozen,
node joined, lease lost, ...). Each event is a flat dict — ``event``, ``time_ms`` (ms since the
epoch), ``run_id``, ``node``, ``round`` (None when no round is concerned), then the event's own
details (the schema: docs/events.md) — logged as one JSON line on the ``etcdrun.events`` logger
and handed to the log's subscribers (the agent's events.jsonl writer and metrics, tests). A
failing subscriber never disturbs the rendezvous. ``time`` (seconds, float) stays beside
``time_ms`` for the readers written before it.

Cost: one dict and, when nobody listens at INFO, no JSON at all; a round emits a few events per
node (bench/results/figures.md).

Why an object per handler and not a module-level list: several handlers can share a process (the
scale bench runs hundreds; two jobs on two etcd clusters may share a run id), and a subscriber
must hear exactly one node's story. The log carries the run id and, once a session is open, the
node id, so no emitter passes them again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("etcdrun.events")
Subscriber = Callable[[dict[str, Any]], None]


class EventLog:
    """The events of one node of one run. Thread-safe; ``emit`` never raises."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.node: str | None = None  # set when a session opens (each incarnation a new id)
        self._lock = threading.Lock()
        self._subscribers: list[Subscriber] = []

    def emit(self, event: str, round: int | None = None, **details: Any) -> dict[str, Any]:
        now = time.time()
        record = {
            "event": event,
            "time_ms": int(now * 1000),
            "time": now,
            "run_id": self.run_id,
            "node": self.node,
            "round": round,
        }
        record.update(details)
        if log.isEnabledFor(logging.INFO):
            log.info(json.dumps(record, default=str, sort_keys=True))
        with self._lock:
            subs = list(self._subscribers)
        for sub in subs:
            try:
                sub(record)
            except Exception:
                log.exception("event subscriber failed")
        return record

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        """Add a subscriber; return a function that removes it."""
        with self._lock:
            self._subscribers.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subscribers:
                    self._subscribers.remove(fn)

        return unsubscribe


__all__ = ["EventLog"]
