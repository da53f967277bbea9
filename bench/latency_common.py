"""What bench/client_latency.py measures with: percentiles, the ours/bare verdict, and the
interleaved timing loop (ours and bare alternate, one call each, so drift hits both alike).
"""

from __future__ import annotations

import time
from collections.abc import Callable

TARGET = 1.2  # ours/bare p50 ratio the foundation issue asks for
REQUEST_TIMEOUT = 2.0  # the bare calls' deadline, the client's default request_timeout
EVENT_TIMEOUT = 5.0  # a watch event slower than this means the watch is broken: give up
now_ns = time.monotonic_ns  # CLOCK_MONOTONIC on Linux: comparable across processes


def percentile(samples: list[int], q: float) -> float:
    """Nearest-rank percentile of nanosecond samples, in milliseconds."""
    s = sorted(samples)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k] / 1e6


def summarize(ours: list[int], bare: list[int]) -> dict:
    o50, b50 = percentile(ours, 50), percentile(bare, 50)
    ratio = o50 / b50 if b50 > 0 else float("inf")
    return {
        "ours": {"p50_ms": o50, "p90_ms": percentile(ours, 90), "samples": len(ours)},
        "bare": {"p50_ms": b50, "p90_ms": percentile(bare, 90), "samples": len(bare)},
        "ratio_p50": ratio,
        "pass": ratio <= TARGET,
    }


def interleave_samples(
    ours: Callable[[], int], bare: Callable[[], int], n: int, warmup: int, budget: float
) -> tuple[list[int], list[int]]:
    """Call ``ours`` and ``bare`` alternately (the order flips every round), each returning one
    sample in nanoseconds; stop early when ``budget`` seconds are spent, so one slow operation
    cannot make the run unbounded.
    """
    t_ours: list[int] = []
    t_bare: list[int] = []
    deadline = time.monotonic() + budget
    for i in range(warmup + n):
        pair = ((ours, t_ours), (bare, t_bare)) if i % 2 == 0 else ((bare, t_bare), (ours, t_ours))
        for fn, out in pair:
            sample = fn()
            if i >= warmup:
                out.append(sample)
        if i >= warmup + 10 and time.monotonic() > deadline:
            break
    return t_ours, t_bare


def timed(fn: Callable[[], None]) -> Callable[[], int]:
    """``fn`` as a sample: its duration in nanoseconds."""

    def run() -> int:
        t0 = time.perf_counter_ns()
        fn()
        return time.perf_counter_ns() - t0

    return run


def interleave(
    ours: Callable[[], None], bare: Callable[[], None], n: int, warmup: int, budget: float
) -> tuple[list[int], list[int]]:
    """Time ``ours`` and ``bare`` alternately (see ``interleave_samples``)."""
    return interleave_samples(timed(ours), timed(bare), n, warmup, budget)
