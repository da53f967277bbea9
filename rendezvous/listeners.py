"""Listeners: the callbacks a port or log tells, added and removed from any thread.

Why one small type: every port that pushes (the hang notices, drain requests) keeps the same
list under the same lock and hands back the same unsubscribe; written out each time, the copies
drift (one removed a callback twice, one called listeners under its lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Listeners(Generic[T]):
    """``add(callback)`` → an unsubscribe; ``tell(value)`` calls each, outside the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[T], None]] = []

    def add(self, callback: Callable[[T], None]) -> Callable[[], None]:
        with self._lock:
            self._callbacks.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)

        return unsubscribe

    def tell(self, value: T) -> None:
        with self._lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(value)


__all__ = ["Listeners"]
