"""Retry policies as small tenacity callables.

Why this shape: the first retry goes straight to the next endpoint (a dead member should cost one
request deadline, not a backoff), and only once every endpoint has been tried do we back off with
jitter, so that many agents hammering a recovering cluster spread out.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import tenacity

from etcdrun.rendezvous.client.errors import is_transient


def failover_wait(n_endpoints: int, base: float = 0.02, cap: float = 0.5) -> Callable:
    """No wait while untried endpoints remain in this sweep; exponential backoff with jitter
    between sweeps."""

    def wait(state: tenacity.RetryCallState) -> float:
        attempt = state.attempt_number  # attempts already made
        if attempt % n_endpoints:
            return 0.0
        sweep = attempt // n_endpoints
        return random.uniform(0, min(cap, base * (2 ** (sweep - 1))))

    return wait


retry_if_transient = tenacity.retry_if_exception(is_transient)


def stop_after(seconds: float, closed: Callable[[], bool]) -> Callable:
    """Stop after ``seconds`` in total, or at once when the client was closed."""
    by_time = tenacity.stop_after_delay(seconds)

    def stop(state: tenacity.RetryCallState) -> bool:
        return closed() or by_time(state)

    return stop
