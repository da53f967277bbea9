"""What the agent tells about itself: its workers' events, the story lines, metrics and health.

Why one object beside the elastic agent: the agent's driver performs the loop's actions and
must stay small; everything that only *reports* (events.jsonl, the console's story, /metrics,
/healthz) hangs off the few moments it calls here — a round asked for, workers started, a worker
exited, workers stopped — and never changes what the agent does. A failure to report never
fails the job.

Worker events (the rendezvous' come from its own EventLog): ``worker_started`` (one per worker),
``workers_restarted`` (once per round after the first, with why), ``worker_exited`` (a worker
that ended by itself: exit code or signal), ``worker_stopped`` (stopped by the agent, with the
signal and why), ``fenced`` (the workers stopped because this node's lease was lost, and how long
before it could expire). Schema: docs/events.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from etcdrun.agent.api import RunResult, Worker
from etcdrun.agent.report import story
from etcdrun.agent.report.event_sink import FILE_NAME, EventSink
from etcdrun.agent.report.metrics import INSTALL, MetricsConfig, MetricStore, prometheus_available
from etcdrun.rendezvous.api import KeptRound, Liveness, RendezvousHandler, RendezvousInfo
from etcdrun.rendezvous.events import EventLog

log = logging.getLogger("etcdrun.agent")


class AgentObserver:
    def __init__(
        self,
        handler: RendezvousHandler,
        event_log_handler: str = "null",
        metrics: MetricsConfig | None = None,
    ) -> None:
        self._report = handler.report()
        self._liveness = handler.liveness()
        self.events = EventLog(handler.get_run_id() or "run")
        self._rdzv_events = self._report.events()
        self._event_handler = event_log_handler
        self._metrics_cfg = metrics or MetricsConfig()
        self.metrics = MetricStore(self._metrics_cfg.handler)
        self.metrics.live = self._live
        self._sink: EventSink | None = None
        self._server: Any = None
        self._unsubscribe: list[Any] = []
        self._lock = threading.Lock()
        self._workers: dict[int, str] = {}  # local rank -> running | exited | succeeded | ...
        self._info: RendezvousInfo | None = None  # the round the workers run in (or ran in)
        self._kept_from: int | None = None  # the round the kept workers came from
        self._kept_count = 0  # how many workers were handed that round
        self._resumes: list[dict[str, Any]] = []  # their ``resumed`` messages so far
        self._phase = "starting"
        self._asked_at: float | None = None
        self.events_path: str | None = None

    # ---- the agent's life ----------------------------------------------------------------------
    def open(self, log_root: str) -> None:
        """Start reporting: events.jsonl under ``log_root``, metrics, the health port."""
        self.events_path = os.path.join(log_root, FILE_NAME)
        self._sink = EventSink(self.events_path, self._event_handler)
        logs = [self.events] + ([self._rdzv_events] if self._rdzv_events is not None else [])
        for ev in logs:
            self._unsubscribe.append(ev.subscribe(self._sink))
        if self._metrics_cfg.handler != "null":
            for ev in logs:
                self._unsubscribe.append(ev.subscribe(self.metrics.on_event))
            self._report.observe(self.metrics.etcd_call)
        if self._metrics_cfg.port is not None:
            self._serve()

    def _serve(self) -> None:
        from etcdrun.agent.report.health import HealthServer

        cfg = self._metrics_cfg
        text = None
        if cfg.handler == "prometheus" and prometheus_available():
            from etcdrun.agent.report.metrics import prometheus_text

            def text() -> bytes:
                return prometheus_text(self.metrics)
        elif cfg.handler == "prometheus":
            log.warning("/metrics needs prometheus-client (%s): serving /healthz only", INSTALL)
        metrics = text or (lambda: None)
        try:
            server = HealthServer(cfg.addr, cfg.port or 0, self.health, metrics)
        except OSError as e:  # a port in use, an address not ours: one line, exit 2
            raise ValueError(f"--metrics-port {cfg.port} on {cfg.addr}: {e.strerror}") from None
        self._server = server.start()
        log.info(
            "serving /healthz, /livez%s on %s:%d",
            ", /metrics" if text else "",
            cfg.addr,
            self._server.port,
        )

    @property
    def port(self) -> int | None:
        return self._server.port if self._server is not None else None

    def close(self) -> None:
        self._phase = "done"
        if self._server is not None:
            self._server.close()
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._report.observe(None)
        if self._sink is not None:
            self._sink.close()

    # ---- the moments the agent reports ------------------------------------------------------
    def joining(self) -> None:
        self._phase = "joining"
        if self._asked_at is None:
            self._asked_at = time.monotonic()

    def started(self, info: RendezvousInfo, workers: list[Worker], lease_lost: bool) -> str | None:
        """Workers run in ``info``'s round: emit their events, return the story line."""
        prev = self._info
        self.events.node = info.node_id
        waited = time.monotonic() - self._asked_at if self._asked_at is not None else None
        self._asked_at = None
        why = story.why_class(info.cause, lease_lost) if prev is not None else "first"
        left = max(0, info.max_restarts - info.restart_count)
        if prev is not None:
            self.events.emit(
                "workers_restarted",
                round=info.round,
                previous_round=prev.round,
                why=why,
                reason=info.cause.reason if info.cause else "",
                restart_count=info.restart_count,
                restarts_left=left,
            )
        with self._lock:
            self._info, self._phase = info, "running"
            self._workers = {w.local_rank: "running" for w in workers}
        for w in workers:
            self.events.emit(
                "worker_started",
                round=info.round,
                local_rank=w.local_rank,
                rank=w.global_rank,
                pid=w.pid,
                restart_count=info.restart_count,
            )
        self._round_metrics(info, why, waited)
        return story.round_change(prev, info, lease_lost)

    def regrouped(self, info: RendezvousInfo, workers: list[Worker]) -> str | None:
        """The kept workers were handed ``info``'s round (in place): one event, the story line
        (the same as a restart's, said to be in place).
        """
        prev = self._info
        waited = time.monotonic() - self._asked_at if self._asked_at is not None else None
        self._asked_at = None
        why = story.why_class(info.cause, False)
        self.events.emit(
            "workers_regrouped",
            round=info.round,
            previous_round=prev.round if prev is not None else None,
            why=why,
            reason=info.cause.reason if info.cause else "",
            restart_count=info.restart_count,
            ranks=[w.global_rank for w in workers],
            world_size=info.world_size,
        )
        with self._lock:
            self._info, self._phase = info, "running"
            self._kept_from = prev.round if prev is not None else None
            self._kept_count, self._resumes = len(workers), []
        self._round_metrics(info, why, waited)
        line = story.round_change(prev, info)
        return line.replace("; new round", "; in place, round", 1) if line else None

    def resumed(self, local_rank: int, msg: dict[str, Any]) -> None:
        """A kept worker trains again in the new round (control channel thread): how long it
        paused, how much state it received. Once every kept worker has said so, the node ranked
        0 tells the backend, once per round, for ``etcdrun status`` (ReportPort.kept): the
        longest pause and form of its workers. Why the longest: a worker blocked in a collective
        on a killed peer counts its pause from the kill, one between steps only from the
        agent's notice, and training waits for the last of them.
        """
        self.events.emit(
            "worker_resumed",
            round=msg.get("round"),
            local_rank=local_rank,
            pause_s=msg.get("pause_s"),
            form_s=msg.get("form_s"),
            sync_bytes=msg.get("sync_bytes"),
            # what gloo still holds of released groups (elastic/group.py Held), so far
            held_collectives=msg.get("held_collectives"),
            forms_left_in_mesh=msg.get("forms_left_in_mesh"),
        )
        with self._lock:
            info, prev = self._info, self._kept_from
            if info is None or info.node_rank != 0 or msg.get("round") != info.round:
                return
            self._resumes.append(msg)
            if len(self._resumes) != self._kept_count:
                return
            resumes = self._resumes
        self._report.kept(
            KeptRound(
                info.round,
                prev,
                info.node_id,
                info.world_size,
                _longest(resumes, "pause_s"),
                _longest(resumes, "form_s"),
                _longest(resumes, "sync_bytes"),
            )
        )

    def _round_metrics(self, info: RendezvousInfo, why: str, waited: float | None) -> None:
        m = self.metrics
        if m.handler == "null":
            return
        m.count("rounds_total", reason=why)
        m.gauge("restarts_spent", info.restart_count)
        m.gauge("restarts_left", max(0, info.max_restarts - info.restart_count))
        if waited is not None:
            m.round_took(waited)

    def exited(self, worker: Worker) -> None:
        """Relay thread: a worker's process ended (its code is known once the attempt ends)."""
        with self._lock:
            if self._workers.get(worker.local_rank) == "running":
                self._workers[worker.local_rank] = "exited"

    def stopped(self, result: RunResult, workers: list[Worker], why: str) -> None:
        """The attempt is over: one event per worker, by how it ended (once per attempt)."""
        with self._lock:
            if self._phase != "running":
                return
            self._phase = "stopping"
        info = self._info
        number = info.round if info is not None else None
        states: dict[int, str] = {}
        for w in workers:
            f = result.failures.get(w.global_rank)
            base = dict(round=number, local_rank=w.local_rank, rank=w.global_rank, pid=w.pid)
            if f is None:
                states[w.local_rank] = "succeeded"
                self.events.emit("worker_exited", **base, exit_code=0, signal=None, how="exit 0")
            elif f.stopped_by_agent:
                states[w.local_rank] = "stopped"
                self.events.emit(
                    "worker_stopped",
                    **base,
                    signal=f.stop_signal,
                    exit_code=f.exitcode,
                    why=why,
                    how="stopped by agent",
                )
            else:
                states[w.local_rank] = "failed"
                how = f.signal or f"exit {f.exitcode}"
                self.events.emit(
                    "worker_exited", **base, exit_code=f.exitcode, signal=f.signal, how=how
                )
        with self._lock:
            self._workers, self._phase = states, "stopped"

    def fenced(self, workers: int) -> None:
        """The workers are gone because the lease was lost (S4): say how close it was."""
        left = self._liveness.read().time_left
        info = self._info
        self.events.emit(
            "fenced",
            round=info.round if info is not None else None,
            workers=workers,
            lease_expires_in_s=round(left, 3) if left is not None else None,
        )
        when = ""
        if left is not None and left >= 0.05:
            when = f", {left:.1f} s before it could expire"
        elif left is not None and left > -0.1:  # lost on time: the workers were paused till now
            when = ", as it could expire"
        elif left is not None:  # the node could not act in time (frozen, suspended): the warden
            when = f", {-left:.1f} s after it could have expired (this node could not act)"
        log.warning(
            "fenced: this node's lease was lost; its %d worker(s) were stopped at once%s; "
            "rejoining as a new node",
            workers,
            when,
        )

    # ---- health and live metrics -----------------------------------------------------------
    def _lease(self) -> tuple[float | None, float | None]:
        """(seconds the lease has left, age of the last keep-alive); (None, None) without."""
        reading = self._liveness.read()
        if reading.time_left is None:
            return None, None
        if reading.state is Liveness.LOST:
            return 0.0, reading.keepalive_age
        return max(0.0, reading.time_left), reading.keepalive_age

    def health(self) -> dict[str, Any]:
        with self._lock:
            info, workers, phase = self._info, dict(self._workers), self._phase
        left, _ = self._lease()
        running = phase == "running" and bool(workers)
        running = running and all(s == "running" for s in workers.values())
        lease_ok = left is None or left > 0
        why = "" if running and lease_ok else ("lease lost" if not lease_ok else phase)
        if why in ("", "running") and not running:  # the round runs, but not all its workers
            why = "workers not running"
        return {
            "healthy": running and lease_ok,
            "why": why,
            "node": self._report.node_id() or self.events.node,  # the port: set before started()
            "round": info.round if info is not None else None,
            "node_rank": info.node_rank if info is not None else None,
            "phase": phase,
            "workers": {str(k): v for k, v in sorted(workers.items())},
            "lease_time_left_s": round(left, 3) if left is not None else None,
        }

    def _live(self) -> dict[str, Any]:
        """What /metrics reads at scrape time: lease, last call, workers by state."""
        with self._lock:
            workers = list(self._workers.values())
        left, lag = self._lease()
        counts = dict.fromkeys(("running", "exited", "succeeded", "failed", "stopped"), 0)
        for s in workers:
            counts[s] = counts.get(s, 0) + 1
        gauges = {"lease_time_to_expiry_seconds": left, "lease_keepalive_lag_seconds": lag}
        call = self._report.last_call()  # 0 when none runs: a gauge that vanishes misleads
        gauges["last_call_seconds_left"] = call.seconds_left(time.time()) if call else 0.0
        return {"gauges": gauges, "workers": counts}


def _longest(resumes: list[dict[str, Any]], field: str) -> Any:
    """The largest of the workers' figures, or None when none of them gave one."""
    given = [r[field] for r in resumes if r.get(field) is not None]
    return max(given) if given else None


__all__ = ["AgentObserver"]
