"""The elastic agent: rendezvous → start workers → wait → act, until the job ends.

Why this loop and no other: every decision that involves other nodes (who is in the round, how
many restarts the job has spent, whether the job failed elsewhere) lives in the rendezvous, so
the agent only reacts to three local facts — its workers exited, the round it runs in was
superseded (``membership_changed``, pushed by an etcd watch), or it got a signal — and to one
shared fact it reads after each, the run being closed.

Signals (SIGTERM, SIGINT, SIGHUP, SIGQUIT) are forwarded to the workers; the agent then leaves the
rendezvous (its lease revoked, so peers start a new round at once) and raises SignalException,
which the CLI turns into exit code 128 + signal (torchrun exits 1).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from etcdrun.agent.api import RunResult, WorkerSpec, WorkerState
from etcdrun.agent.errors import ChildFailedError, ProcessFailure, root_cause, write_error_json
from etcdrun.agent.workers import WorkerGroup
from etcdrun.rendezvous.api import FailureInfo, RendezvousHandler, RendezvousInfo
from etcdrun.rendezvous.errors import RendezvousClosedError

log = logging.getLogger("etcdrun.agent")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class SignalException(Exception):
    """The agent got a termination signal; ``sigval`` is it (exit code 128 + sigval)."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


class ElasticAgent:
    """Runs one node's share of the job. ``run()`` returns the last attempt's RunResult (the
    launcher raises ChildFailedError for a failed one) or raises ChildFailedError itself when
    another node closed the run as failed."""

    def __init__(
        self,
        spec: WorkerSpec,
        log_dir: str | None = None,
        *,
        status_interval: float = 5.0,
        console_out: Any = None,
        console_err: Any = None,
    ) -> None:
        if spec.rdzv_handler is None:
            raise ValueError("WorkerSpec.rdzv_handler is required")
        self._spec = spec
        self._h: RendezvousHandler = spec.rdzv_handler
        self._group = WorkerGroup(
            log_dir or spec.log_dir, console_out=console_out, console_err=console_err
        )
        self._status_interval = status_interval
        self._failed: tuple[str, RunResult] | None = None  # (node id, result) of our failure
        self._deferred: int | None = None
        self._defer = 0
        self.rounds = 0  # rounds this agent started workers in

    # ---- public --------------------------------------------------------------------------
    def run(self) -> RunResult:
        previous = self._install_signal_handlers()
        try:
            return self._loop()
        except SignalException as e:
            log.warning("got %s: forwarding it to the workers and leaving the job", e.sigval.name)
            self._stop_workers(forward=e.sigval)
            raise
        finally:
            self._restore_signal_handlers(previous)
            self._group.close()

    @property
    def group(self) -> WorkerGroup:
        return self._group

    # ---- the loop ------------------------------------------------------------------------
    def _loop(self) -> RunResult:
        spec, h = self._spec, self._h
        while True:
            try:
                info = self._rendezvous()
            except RendezvousClosedError:
                ours = self._closed_by_failure()  # raises for another node's failure
                if ours is not None:
                    log.error("the restart budget is spent: the job failed")
                    return ours
                raise
            with self._deferring():
                self._group.start(spec, info)
            self.rounds += 1
            log.info(
                "round %d: node rank %d of %d, ranks %d..%d of %d, restarts %d/%d",
                info.round,
                info.node_rank,
                info.node_count,
                info.first_global_rank,
                info.first_global_rank + spec.local_world_size - 1,
                info.world_size,
                info.restart_count,
                info.max_restarts,
            )
            result = self._wait(info)
            if result is None:  # the round was superseded (or our lease was lost)
                lost = h.session_lost()
                self._stop_workers(grace=0.0 if lost else None)
                reason = "lease lost" if lost else (h.round_reason() or "membership changed")
                log.info("round %d superseded (%s): restarting workers", info.round, reason)
                self._raise_if_failed_elsewhere()
                continue
            if result.state == WorkerState.SUCCEEDED:
                final = self._stop_workers()
                log.info("round %d: workers succeeded; waiting for the other nodes", info.round)
                if not h.exit_barrier():
                    self._raise_if_failed_elsewhere()
                    log.warning("not every node finished in time; leaving anyway")
                return final
            final = self._stop_workers()
            failure, what = _failure_of(info, final)
            # One path for every backend: the rendezvous owns the budget. It grants the restart
            # or closes the run with this failure (the next rendezvous then raises), and with
            # etcd a failure caused by a peer's death costs nothing.
            log.warning(
                "round %d: %s; asking for a restart (%d of %d spent)",
                info.round,
                what,
                info.restart_count,
                info.max_restarts,
            )
            self._failed = (info.node_id, final)
            with self._deferring():
                h.request_restart(what, failure)

    def _rendezvous(self) -> RendezvousInfo:
        """next_rendezvous() with one status line every few seconds while it waits."""
        done = threading.Event()
        started = time.monotonic()

        def ticker() -> None:
            while not done.wait(self._status_interval):
                log.info(
                    "waiting for a round (%.0f s): %s",
                    time.monotonic() - started,
                    self._h.status() or "...",
                )

        th = threading.Thread(target=ticker, name="etcdrun-status", daemon=True)
        th.start()
        try:
            return self._h.next_rendezvous()
        finally:
            done.set()
            th.join()

    def _wait(self, info: RendezvousInfo) -> RunResult | None:
        """Until the workers end (their result) or the round is superseded (None)."""
        changed = self._h.membership_changed
        while True:
            self._check_deferred()
            if changed.is_set():
                return None
            result = self._group.poll()
            if result is not None:
                return result
            changed.wait(self._spec.monitor_interval)

    def _stop_workers(
        self, grace: float | None = None, forward: signal.Signals | None = None
    ) -> RunResult:
        with self._deferring():
            if forward is not None:
                self._group.signal_all(forward)
            return self._group.stop(grace)

    def _closed_by_failure(self) -> RunResult | None:
        """The run was closed as failed: our own failure's result (the launcher reports it
        with our workers' error files), or ChildFailedError with another node's root cause."""
        failure = self._h.closed_failure()
        if failure is None:
            return None
        if self._failed is not None and failure.node_id == self._failed[0]:
            return self._failed[1]
        self._raise_if_failed_elsewhere()
        return None

    def _raise_if_failed_elsewhere(self) -> None:
        failure = self._h.closed_failure()
        if failure is None:
            return
        path = self._write_remote_error(failure)
        pf = ProcessFailure(
            local_rank=failure.local_rank,
            pid=failure.pid,
            exitcode=failure.exit_code,
            error_file=path,
            global_rank=failure.global_rank,
            host=failure.host,
            exit_time=failure.timestamp,
        )
        raise ChildFailedError(
            name=self._spec.get_entrypoint_name(), failures={failure.global_rank: pf}
        )

    def _write_remote_error(self, f: FailureInfo) -> str:
        """The remote root cause, as an error file in our own log dir (torch's format)."""
        d = os.path.join(self._group.log_root(), self._h.get_run_id() or "run")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"root_cause_rank{f.global_rank}.json")
        write_error_json(path, f.message or f"exit code {f.exit_code}", f.traceback, f.timestamp)
        return path

    # ---- signals ---------------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may handle signals (embedded use)
        previous = {}
        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._defer:
            self._deferred = signum  # raised as soon as the critical section ends
            return
        raise SignalException(f"process {os.getpid()} got signal {signum}", signal.Signals(signum))

    def _check_deferred(self) -> None:
        if self._deferred is not None and not self._defer:
            sig, self._deferred = self._deferred, None
            raise SignalException(f"process {os.getpid()} got signal {sig}", signal.Signals(sig))

    def _deferring(self) -> _Deferring:
        return _Deferring(self)


class _Deferring:
    """A critical section (starting/stopping workers, a fenced write) that a signal must not
    cut in half: the signal is held and raised right after."""

    def __init__(self, agent: ElasticAgent) -> None:
        self.agent = agent

    def __enter__(self) -> None:
        self.agent._defer += 1

    def __exit__(self, *exc: object) -> None:
        self.agent._defer -= 1
        if exc[0] is None:
            self.agent._check_deferred()


def _failure_of(info: RendezvousInfo, final: RunResult) -> tuple[FailureInfo, str]:
    """The root cause of a failed attempt, as every node will report it, and one line on it."""
    rank, root = root_cause(final.failures)
    failure = FailureInfo(
        node_id=info.node_id,
        host=root.host,
        global_rank=rank,
        exit_code=root.exitcode,
        signal_name=root.signal or "",
        message=root.message,
        traceback=root.traceback,
        timestamp=root.timestamp,
        local_rank=root.local_rank,
        pid=root.pid,
    )
    return failure, f"worker rank {rank} on {root.host} failed ({root.exit_description()})"


# torch's (and the reference launcher's) name for the same agent.
LocalElasticAgent = ElasticAgent
