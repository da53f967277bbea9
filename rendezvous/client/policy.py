"""RetryPolicy: the one answer to "how long does X wait, retry, and how fast?".

Why one object: many loops need the answer (the transport's first try and its tenacity loop, the
keep-alive tick, the watch's reconnect backoff, the leader's and the driver's retry delays, the
handler's waits, the clean-up's deadline), and where each keeps its own, changing
``request_timeout`` or ``retry_timeout`` changes some loops and not others. Every loop asks this
object, built once from the configuration (``ClientConfig.policy``); tests/client/test_policy.py
changes the two settings and checks that every loop follows.

The rules it encodes:
- one request on one endpoint gets ``request_timeout`` (a request in flight to a follower when the
  leader dies is never answered: measured, it waits for the deadline every time, so the deadline
  must be short and the call retried elsewhere);
- a call gets ``retry_timeout`` in all, across endpoints: the first retry goes straight to the next
  endpoint (a dead member should cost one deadline, not a backoff); between sweeps over all
  endpoints we back off exponentially with full jitter, from ``backoff_base`` up to
  ``backoff_cap``, so that many agents hitting a recovering cluster spread out;
- loops that retry by themselves (keep-alive, watch reconnect, leader, driver) use the same
  backoff, indexed by how many times in a row they failed.

Both backoff bounds follow ``request_timeout`` (base 1/40 of it, cap 1/2: 0.05 s and 1 s by
default): backing off longer than half a request deadline only delays recovery, and a cluster tuned
for short deadlines gets short backoffs too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RetryPolicy:
    request_timeout: float = 2.0  # one attempt on one endpoint
    retry_timeout: float = 30.0  # one call across endpoints, then a clear error

    def __post_init__(self) -> None:
        if self.request_timeout <= 0 or self.retry_timeout <= 0:
            raise ValueError("etcd timeouts must be positive")

    @property
    def backoff_base(self) -> float:
        """The first backoff between sweeps / failed loop iterations."""
        return self.request_timeout / 40.0

    @property
    def backoff_cap(self) -> float:
        """Never back off longer than this."""
        return self.request_timeout / 2.0

    # ---- backoff -----------------------------------------------------------------------------
    def backoff_limit(self, failures: int) -> float:
        """The longest wait after ``failures`` failures in a row (1 → base, doubling, capped)."""
        if failures <= 0:
            return 0.0
        return min(self.backoff_cap, self.backoff_base * 2 ** min(failures - 1, 30))

    def backoff(self, failures: int) -> float:
        """A jittered wait after ``failures`` failures in a row: uniform in [0, limit]."""
        return random.uniform(0.0, self.backoff_limit(failures))

    # ---- unary calls -------------------------------------------------------------------------
    def call_timeout(self, timeout: float | None = None) -> float:
        """The budget of one call across endpoints (a caller may ask for less)."""
        return self.retry_timeout if timeout is None else min(timeout, self.retry_timeout)

    def retrying(
        self,
        n_endpoints: int,
        closed: Callable[[], bool],
        timeout: float | None,
        retryable: Callable[[BaseException], bool] | None = None,
    ) -> Any:
        """A tenacity loop for one call; built only after the bare first try failed (importing
        tenacity costs an agent CPU it need not spend, bench/results/figures.md, and almost every
        call succeeds the first time). ``retryable`` decides which errors are worth another attempt
        (default: transient).
        """
        import tenacity

        from etcdrun.rendezvous.client.errors import is_transient

        by_time = tenacity.stop_after_delay(self.call_timeout(timeout))

        def wait(state: tenacity.RetryCallState) -> float:
            attempt = state.attempt_number  # attempts already made
            if attempt % n_endpoints:
                return 0.0  # untried endpoints remain in this sweep
            return self.backoff(attempt // n_endpoints)

        def stop(state: tenacity.RetryCallState) -> bool:
            return closed() or by_time(state)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(retryable or is_transient),
            wait=wait,
            stop=stop,
            reraise=True,
        )

    # ---- the lease keep-alive ----------------------------------------------------------------
    def keepalive_interval(self, ttl: float) -> float:
        """A lease is refreshed every TTL/3: two ticks may fail before it is in danger."""
        return ttl / 3.0

    def keepalive_batch_window(self, ttl: float) -> float:
        """When a tick is due, leases due within this much later go along on the same stream
        (refreshed early, never late): a client keeping many leases (bench/rendezvous_scale.py's
        simulated nodes) then sends a few batches per interval instead of a stream per lease,
        and in-process contention for the GIL is paid per batch.
        """
        return self.keepalive_interval(ttl) / 4.0

    def keepalive_timeout(self, ttl: float, until_presumed_lost: float) -> float:
        """One keep-alive tick never outlasts the moment its lease must be presumed lost: the
        check after it has to happen on time, or fencing eats into the margin it exists for.
        """
        return min(
            self.request_timeout,
            max(0.1, self.keepalive_interval(ttl)),
            max(0.05, until_presumed_lost),
        )

    def keepalive_retry_in(self, failures: int, until_presumed_lost: float) -> float:
        """After a failed tick: retry soon (next endpoint), never past the presumed loss."""
        return max(0.0, min(self.backoff_limit(failures), until_presumed_lost))

    # ---- bounded best-effort work at exit ------------------------------------------------------
    @property
    def parting_timeout(self) -> float:
        """A last request on the way out (revoke, clean-up): one attempt's worth, not a retry
        budget — leaving must not hang on a dead etcd.
        """
        return self.request_timeout

    @property
    def thread_stop_timeout(self) -> float:
        """How long stopping a thread that may be inside one call can take."""
        return self.retry_timeout + self.request_timeout


__all__ = ["RetryPolicy"]
