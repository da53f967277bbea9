"""One structured event per state transition.

Why one function: status tools, metrics and tests all want the same facts (round opened, frozen,
node joined, lease lost, ...). Each event is a flat dict, logged as one JSON line on the
``etcdrun.events`` logger and handed to subscribers (in-process hooks such as tests or a metrics
exporter). A failing subscriber never disturbs the rendezvous.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("etcdrun.events")
_lock = threading.Lock()
_subscribers: list[Callable[[dict[str, Any]], None]] = []


def emit(event: str, **fields: Any) -> dict[str, Any]:
    record = {"event": event, "time": round(time.time(), 6), **fields}
    if log.isEnabledFor(logging.INFO):
        log.info(json.dumps(record, default=str, sort_keys=True))
    with _lock:
        subs = list(_subscribers)
    for sub in subs:
        try:
            sub(record)
        except Exception:
            log.exception("event subscriber failed")
    return record


def subscribe(fn: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """Add a subscriber; return a function that removes it."""
    with _lock:
        _subscribers.append(fn)

    def unsubscribe() -> None:
        with _lock:
            if fn in _subscribers:
                _subscribers.remove(fn)

    return unsubscribe
