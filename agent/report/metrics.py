"""The agent's metrics: what an operator graphs and alerts on, from the events and the client.

Why built on the events: every transition already goes through an EventLog (rendezvous/events.py
and the agent's own), so the metrics subscribe to them instead of being threaded through the
rendezvous; only etcd's request latency (the client's transport) and the lease's state (read at
scrape time) come from elsewhere. Nothing here is on the rendezvous' hot path: with the null
handler nothing is even subscribed, and an etcd call then costs one attribute test.

Handlers (``LaunchConfig.metrics_cfg["handler"]``; torch's names where torch has them):

- ``null``: nothing (default without a port);
- ``console``: one line per data point on stderr, torch's ``[time][etcdrun]: name=value``;
- ``prometheus``: the agent serves ``/metrics`` on ``metrics_cfg["port"]`` (``--metrics-port``;
  the default handler when a port is given). It needs the optional ``prometheus-client``
  (``pip install 'etcdrun[prometheus]'``), imported only then: the agent without it starts as
  fast as before. ``/healthz`` and ``/livez`` (agent/report/health.py) need nothing.

Metric names (Prometheus): see ``PROMETHEUS`` below and README's table.
"""

from __future__ import annotations

import bisect
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

HANDLERS = ("null", "console", "prometheus")
KEYS = ("handler", "port", "addr")
ROUND_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ETCD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
INSTALL = "pip install 'etcdrun[prometheus]'"


@dataclass(frozen=True)
class MetricsConfig:
    handler: str = "null"
    port: int | None = None
    addr: str = "0.0.0.0"
    implicit: bool = False  # the handler was not asked for: prometheus only because of a port

    @classmethod
    def from_cfg(cls, cfg: dict[str, Any] | None) -> MetricsConfig:
        """``LaunchConfig.metrics_cfg``: one clear ValueError for a key or value that is wrong."""
        cfg = dict(cfg or {})
        unknown = sorted(set(cfg) - set(KEYS))
        if unknown:
            raise ValueError(f"metrics_cfg: unknown key(s) {', '.join(unknown)} (known: {KEYS})")
        port = None
        if cfg.get("port") not in (None, ""):
            try:
                port = int(cfg["port"])
            except (TypeError, ValueError):
                raise ValueError(f"--metrics-port {cfg['port']!r}: not a port number") from None
            if not 0 <= port <= 65535:
                raise ValueError(f"--metrics-port {port}: not a port number (0-65535)")
        handler = str(cfg.get("handler") or ("prometheus" if port is not None else "null"))
        if handler not in HANDLERS:
            raise ValueError(f"metrics handler {handler!r}: use one of {', '.join(HANDLERS)}")
        if handler == "prometheus" and port is None:
            raise ValueError("the prometheus metrics handler needs a port (--metrics-port)")
        addr = str(cfg.get("addr") or "0.0.0.0")
        return cls(handler, port, addr, implicit="handler" not in cfg)


class Histogram:
    """Buckets, count and sum; thread-safe; an observation is one bisect and three additions
    (bench/results/figures.md).
    """

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class MetricStore:
    """Everything counted so far, and the handler's way of showing a data point."""

    def __init__(self, handler: str = "null", console: TextIO | None = None) -> None:
        self.handler = handler
        self._console = (console or sys.stderr) if handler == "console" else None
        self._lock = threading.Lock()
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.round_duration = Histogram(ROUND_BUCKETS)
        self.etcd: dict[str, Histogram] = {}
        self.gauges: dict[str, float] = {}
        self.live: Callable[[], dict[str, Any]] = dict  # read at scrape time (see health.py)

    # ---- what the agent reports --------------------------------------------------------------
    def count(self, name: str, by: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self.counters[key] = self.counters.get(key, 0.0) + by
            value = self.counters[key]
        self._say(name, value, labels)

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = value
        self._say(name, value, {})

    def round_took(self, seconds: float) -> None:
        with self._lock:
            self.round_duration.observe(seconds)
        self._say("round_duration_ms", int(seconds * 1000), {})

    def etcd_call(self, method: str, seconds: float, error: str | None) -> None:
        """The transport's observer (any thread, the hot path: no console line here)."""
        with self._lock:
            h = self.etcd.get(method)
            if h is None:
                h = self.etcd[method] = Histogram(ETCD_BUCKETS)
            h.observe(seconds)
            if error is not None:
                key = ("etcd_request_errors_total", (("error", error), ("method", method)))
                self.counters[key] = self.counters.get(key, 0.0) + 1

    def _say(self, name: str, value: float, labels: dict[str, str]) -> None:
        if self._console is None:
            return
        tag = "".join(f",{k}={v}" for k, v in sorted(labels.items()))
        self._console.write(f"[{time.time():.3f}][etcdrun]: {name}{tag}={value:g}\n")
        self._console.flush()

    # ---- from the events ---------------------------------------------------------------------
    def on_event(self, e: dict[str, Any]) -> None:
        """A subscriber of the handler's and the agent's EventLogs (the rounds' own figures
        come from agent/report/observer.py, which knows when this node asked for each).
        """
        name = e.get("event")
        if name == "session_lost":
            self.count("lease_lost_total")
        elif name == "fenced":
            self.count("fenced_total")
        elif name == "round_accepted":
            self.gauge("round", float(e.get("round") or 0))
            self.gauge("node_rank", float(e.get("node_rank", -1)))
        elif name in ("worker_exited", "worker_stopped"):
            self.count("worker_exits_total", how=str(e.get("how", "exit")))

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy for the exposition."""
        with self._lock:
            return {
                "counters": dict(self.counters),
                "gauges": dict(self.gauges),
                "round": (self.round_duration.cumulative(), self.round_duration.sum),
                "etcd": {m: (h.cumulative(), h.sum) for m, h in self.etcd.items()},
            }


# name -> (type, help): the Prometheus exposition (all prefixed etcdrun_)
PROMETHEUS = {
    "round_duration_seconds": ("histogram", "time from asking for a round to running in it"),
    "rounds_total": ("counter", "rounds this node started workers in, by why the round opened"),
    "round": ("gauge", "the round this node runs in (0: none yet)"),
    "node_rank": ("gauge", "this node's rank in its round (-1: none)"),
    "restarts_spent": ("gauge", "job-wide restarts charged so far"),
    "restarts_left": ("gauge", "job-wide restarts left of the budget"),
    "workers": ("gauge", "this node's workers, by state"),
    "worker_exits_total": ("counter", "worker exits, by how (code, signal, stopped by agent)"),
    "etcd_request_duration_seconds": ("histogram", "etcd unary calls, by method (retries in)"),
    "etcd_request_errors_total": ("counter", "etcd calls that failed for good, by method, error"),
    "lease_keepalive_lag_seconds": ("gauge", "since the last acknowledged keep-alive was sent"),
    "lease_time_to_expiry_seconds": ("gauge", "before etcd could expire this node's lease"),
    "last_call_seconds_left": ("gauge", "first round: the leader's last call, seconds left"),
    "lease_lost_total": ("counter", "leases declared lost (the node fences itself, rejoins)"),
    "fenced_total": ("counter", "times this node stopped its workers because its lease was lost"),
}


# Every counter's label names: each family is exposed from the first scrape (an unlabelled one
# at 0), so an alert on it reads 0, not "no data" (a new user's scrape lacked four of them).
COUNTER_LABELS: dict[str, tuple[str, ...]] = {
    "rounds_total": ("reason",),
    "worker_exits_total": ("how",),
    "etcd_request_errors_total": ("error", "method"),
    "lease_lost_total": (),
    "fenced_total": (),
}


def prometheus_text(store: MetricStore) -> bytes:
    """The exposition, built by prometheus-client from the store (imported here only)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    snap, live = store.snapshot(), store.live()

    class _Collector:
        def collect(self) -> Any:
            fams: dict[str, Any] = {}

            def fam(name: str, labels: tuple[str, ...] = ()) -> Any:
                if name not in fams:
                    kind, text = PROMETHEUS[name]
                    cls = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}.get(kind)
                    if cls is None:
                        cls = HistogramMetricFamily
                    base = name.removesuffix("_total") if kind == "counter" else name
                    fams[name] = cls(f"etcdrun_{base}", text, labels=list(labels))
                return fams[name]

            for name, labels in COUNTER_LABELS.items():  # present (0 when unlabelled) from start
                fam(name, labels)
                if not labels and (name, ()) not in snap["counters"]:
                    fam(name).add_metric([], 0.0)
            for (name, labels), value in snap["counters"].items():
                fam(name, tuple(k for k, _ in labels)).add_metric([v for _, v in labels], value)
            for name, value in {**snap["gauges"], **live.get("gauges", {})}.items():
                if value is not None:
                    fam(name).add_metric([], value)
            for state, n in live.get("workers", {}).items():
                fam("workers", ("state",)).add_metric([state], n)
            buckets, total = snap["round"]
            fam("round_duration_seconds").add_metric([], buckets, total)
            for method, (buckets, total) in sorted(snap["etcd"].items()):
                fam("etcd_request_duration_seconds", ("method",)).add_metric(
                    [method], buckets, total
                )
            yield from fams.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    return generate_latest(registry)


def prometheus_available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


__all__ = [
    "HANDLERS",
    "INSTALL",
    "MetricStore",
    "MetricsConfig",
    "PROMETHEUS",
    "prometheus_available",
    "prometheus_text",
]
