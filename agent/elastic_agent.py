"""The elastic agent: the driver of agent/loop.py's decisions, until the job ends.

Why a driver over a pure function: every decision (rejoin, restart, barrier, whose failure closed
the run) is ``loop.next_step``'s, tested without processes; this module only performs the
actions — join, start, stop, ask for a restart, wait at the barrier, raise — and turns what
happened into the next event. Every decision that involves other nodes lives in the rendezvous,
so the agent only reacts to three local facts — its workers exited, the round it runs in was
superseded (``membership_changed``, pushed by an etcd watch), or it got a signal — and to one
shared fact it reads after each, the run being closed.

Why one event: the workers' exit callback (a pidfd readable) and ``on_membership_change`` set
it: it wakes at once, never polls (``monitor_interval`` paces only pidfd-less workers).

Signals (``--signals-to-handle``: SIGTERM, SIGINT, SIGHUP, SIGQUIT by default) are forwarded to
the workers as torchrun does: that signal, then SIGKILL after the grace (``--shutdown-timeout``);
the agent then leaves the rendezvous (its lease revoked, so peers start a new round at once) and
raises SignalException, which the CLI turns into exit code 128 + signal (torchrun exits 1).
Starting and stopping workers and the fenced restart request are critical sections: a signal
there is held until they end (agent/signals.py).

A drain (agent/drain.py, docs/drain.md) is a fourth fact, pushed like the others: the node was
asked to leave; its workers stop normally, it leaves the rendezvous and returns, charging
nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, NoReturn

from etcdrun.agent import loop
from etcdrun.agent.api import RunResult, WorkerSpec, WorkerState
from etcdrun.agent.drain import Drain
from etcdrun.agent.errors import ChildFailedError, ProcessFailure, write_error_json
from etcdrun.agent.fencing.guard import Fencing
from etcdrun.agent.grace import stop_grace
from etcdrun.agent.hang.pace import PacePublisher
from etcdrun.agent.hang.watchdog import HangWatchdog
from etcdrun.agent.in_place import InPlace
from etcdrun.agent.report import story
from etcdrun.agent.report.metrics import MetricsConfig
from etcdrun.agent.report.observer import AgentObserver
from etcdrun.agent.signals import SignalException, SignalGate
from etcdrun.agent.standby import pool as standby
from etcdrun.agent.worker import file_timer
from etcdrun.agent.worker.group import WorkerGroup
from etcdrun.rendezvous.api import FailureInfo, Liveness, RendezvousHandler, RendezvousInfo
from etcdrun.rendezvous.errors import RendezvousClosedError

log = logging.getLogger("etcdrun.agent")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
HANDED_EXIT_WAIT = 2.0  # s: a kept worker whose channel closed at the hand-over may be exiting


class ElasticAgent:
    """Runs one node's share of the job. ``run()`` returns the last attempt's RunResult (the
    launcher raises ChildFailedError for a failed one) or raises ChildFailedError itself when
    another node closed the run as failed.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        log_dir: str | None = None,
        *,
        status_interval: float = 5.0,
        console_out: Any = None,
        console_err: Any = None,
        event_log_handler: str = "null",
        metrics: MetricsConfig | None = None,
        early: standby.Early | None = None,  # the standbys the launcher started, to take over
    ) -> None:
        if spec.rdzv_handler is None:
            raise ValueError("WorkerSpec.rdzv_handler is required")
        self._spec = spec
        self._h: RendezvousHandler = spec.rdzv_handler
        self._liveness = self._h.liveness()
        self._report = self._h.report()
        self._progress = self._h.progress()
        self._wake = threading.Event()  # a worker exited, the membership changed, a drain
        self._drain = Drain(self._h.drain(), self._h.get_run_id(), self._wake.set)
        self._signals = SignalGate(spec.signals_to_handle, self._drain, spec.on_sigterm)
        self._fencing = Fencing(self._liveness, early and early.tag)  # the warden
        self.observer = AgentObserver(self._h, event_log_handler, metrics)
        self._in_place = InPlace(self._fencing.tag, self.observer.resumed)  # design.md §4a
        self._timer = None  # torch's FileTimer, when the agent's environment asks for it
        if file_timer.enabled():
            self._timer = file_timer.FileTimerServer(os.environ.get(file_timer.FILE_VAR))
        timer_env = self._timer.env if self._timer is not None else {}
        env = {**self._fencing.env, **self._in_place.env, **timer_env}
        self._standbys = early.pool if early else standby.for_agent(spec, env)
        self._group = WorkerGroup(
            log_dir or spec.log_dir,
            console_out=console_out,
            console_err=console_err,
            on_exit=self._on_exit,
            on_spawn=self._fencing.spawned,
            extra_env=env,
            standbys=self._standbys,
            paced=self._progress.enabled(),
        )
        self._given_log_dir = log_dir or spec.log_dir
        self._lease_lost = False  # the last attempt ended because our lease was lost
        self._status_interval = status_interval
        self._state = loop.State()
        self._closed_error: RendezvousClosedError | None = None
        self.rounds = 0  # rounds this agent started workers in

    # ---- public --------------------------------------------------------------------------
    def run(self) -> RunResult:
        unsubscribe = self._h.on_membership_change(self._wake.set)
        self._drain.start()
        self._fencing.start(self._wake.set)
        self._in_place.start()
        if self._timer is not None:
            timers = file_timer.WorkerTimers(self._group, self.observer.events)
            self._timer.start(timers.is_worker, timers.expired)
        hangs = None
        if self._spec.hang_timeout is not None:
            hangs = HangWatchdog(
                self._group,
                self._h.hang(),
                self._spec.hang_timeout,
                self._report.node_id,
                self.observer.events,
                leave=self._leave_for_hang,
            )
            hangs.start()
        pace = PacePublisher(self._group, self._progress) if self._progress.enabled() else None
        if pace is not None:
            pace.start()
        standby.start(self._standbys)  # ahead of the first round
        result: RunResult | None = None
        try:
            self.observer.open(self._group.log_root())
            result = self._run_with_signals()
            return result
        finally:
            unsubscribe()
            self._drain.close()
            self._group.close()
            standby.close(self._standbys)
            self._fencing.close()
            self._in_place.close()
            if self._timer is not None:
                self._timer.close()
            if hangs is not None:
                hangs.close()
            if pace is not None:
                pace.close()
            self._h.shutdown()  # leave before the event log closes: its node_left is kept
            self.observer.close()
            succeeded = result is not None and not result.is_failed()
            kept = self._group.settle_logs(succeeded)
            if kept is not None:
                log.info(story.logs_kept(kept, succeeded))

    def _leave_for_hang(self) -> bool:
        """The hang watchdog's thread: blamed for a hang, this node leaves the job when its
        workers run in place and the others can go on without it (docs/hangs.md).
        """
        if not self._in_place.ready(self._group, self._spec.local_world_size):
            return False
        return self._drain.take_blame("the hang watchdog")

    def _on_exit(self, worker: Any) -> None:
        self.observer.exited(worker)
        self._wake.set()

    def _say_where_logs_are(self) -> None:
        log.info(
            "%s",
            story.logs_line(
                self._group.log_root(), self._h.get_run_id(), bool(self._given_log_dir)
            ),
        )

    @property
    def group(self) -> WorkerGroup:
        return self._group

    @property
    def state(self) -> loop.State:
        """Where the loop stands (for tests and debugging)."""
        return self._state

    # ---- the driver ----------------------------------------------------------------------
    def _run_with_signals(self) -> RunResult:
        previous = self._signals.install()
        try:
            return self._drive()
        except SignalException as e:
            self._drain.stopped(e.sigval.name)  # the run CANCELLED when every node went so
            self._perform(self._step(loop.Signal(int(e.sigval))))
            raise
        finally:
            self._signals.restore(previous)

    def _drive(self) -> RunResult:
        standby.wait_warm(self._standbys, self._h.job_running)  # before a running job's stop
        step = loop.Step(self._state, loop.Join())
        while not isinstance(step.action, loop.ReturnResult):
            event = self._perform(step)
            assert event is not None, step.action
            step = self._step(event)
        self._note(step.action)
        return step.action.result

    def _step(self, event: loop.Event) -> loop.Step:
        step = loop.next_step(self._state, event)
        self._state = step.state
        return step

    @staticmethod
    def _note(action: loop.Action) -> None:
        if action.note:
            log.log(action.level, "%s", action.note)

    def _perform(self, step: loop.Step) -> loop.Event | None:
        """Do ``step.action``; the event it ended with (None: the last action, which raises
        or ends the loop).
        """
        self._note(step.action)
        return _PERFORM[type(step.action)](self, step.action)

    def _join(self, action: loop.Join) -> loop.Event:
        self.observer.joining()
        if self._drain.pending is not None:
            return self._drain.pending
        try:
            info = self._rendezvous()
        except RendezvousClosedError as exc:
            if self._drain.pending is not None:  # the rendezvous stopped waiting for us
                return self._drain.pending
            self._closed_error = exc
            return loop.RunClosed(self._h.closed_failure(), exc.succeeded)
        self._check_budget(info)
        return loop.Joined(info)

    def _check_budget(self, info: RendezvousInfo) -> None:
        """WorkerSpec.max_restarts, when given, must be the rendezvous' own budget (the
        rendezvous decides every restart; see WorkerSpec): refused with one line otherwise.
        """
        wanted = self._spec.max_restarts
        if wanted is not None and wanted != info.max_restarts:
            raise ValueError(
                f"run {info.run_id} round {info.round} node {info.node_id}: "
                f"WorkerSpec.max_restarts={wanted}, but the rendezvous' restart budget is "
                f"{info.max_restarts}; the budget is job-wide, so give it to the rendezvous "
                "(LaunchConfig.max_restarts, --max-restarts, or its config's max_restarts)"
            )

    def _start(self, action: loop.StartWorkers) -> loop.Event:
        info = action.info
        self._group.add_env(self._in_place.peer_wait(self._liveness))
        with self._signals.holding():
            workers = self._group.start(self._spec, info)
            self._fencing.started()
        self.rounds += 1
        if self.rounds == 1:
            self._say_where_logs_are()
        line = self.observer.started(info, workers, self._lease_lost)
        self._lease_lost = False
        if line:
            log.warning("%s", line)
        self._say_round(info)
        if any(self._spec.redirect_map().values()) or any(self._spec.tee_map().values()):
            log.info("round %d: worker output in %s/<rank>/", info.round, self._group.attempt_dir)
        return self._wait()

    def _regroup(self, action: loop.Regroup) -> loop.Event:
        """The kept workers hear at once that their round is over (they release collectives
        blocked on a lost peer and wait), then this node joins the next round.
        """
        self._in_place.abort(action.round, self._spec.local_world_size)
        return self._join(loop.Join())

    def _hand_over(self, action: loop.HandOver) -> loop.Event:
        """The kept workers get the new round's environment over the control channel."""
        info = action.info
        ended = self._group.poll()
        if ended is not None and ended.state == WorkerState.SUCCEEDED:
            return loop.WorkersSucceeded(earlier=True)  # they finished while this node joined
        if not self._in_place.hand_over(self._group, info):
            # A closed channel is most often a worker ending: its function returned just before
            # the hand-over (the link closes, the process exits a moment later).
            ended = self._group.wait(HANDED_EXIT_WAIT)
            if ended is not None and ended.state == WorkerState.SUCCEEDED:
                return loop.WorkersSucceeded(earlier=True)
            if ended is not None:
                return loop.WorkersFailed()
            return loop.HandOverFailed()
        self.rounds += 1
        line = self.observer.regrouped(info, self._group.workers)
        if line:
            log.warning("%s", line)
        self._say_round(info)
        return self._wait()

    def _say_round(self, info: RendezvousInfo) -> None:
        log.info(
            "round %d: node rank %d of %d, ranks %d..%d of %d, restarts %d/%d",
            info.round,
            info.node_rank,
            info.node_count,
            info.first_global_rank,
            info.first_global_rank + self._spec.local_world_size - 1,
            info.world_size,
            info.restart_count,
            info.max_restarts,
        )

    def _stop(self, action: loop.StopWorkers) -> loop.Event:
        spec = self._spec
        grace = stop_grace(action.grace, action.restart, spec.stop_grace, spec.restart_grace)
        st = self._state
        if st.then is loop.Then.DRAIN:  # in place: at the workers' next commit
            changed = self._h.membership_changed
            grace = self._in_place.stop_at_commit(
                self._group, spec.local_world_size, grace, changed.is_set
            )
        result = self._stop_workers(grace=grace)
        why = st.reason or (st.then.value if st.then is not None else "")
        self.observer.stopped(result, self._group.workers, why)
        if st.then is loop.Then.FENCED:
            self._lease_lost = True
            self.observer.fenced(len(self._group.workers))
        return loop.WorkersStopped(result, self._h.closed_failure())

    def _restart(self, action: loop.RequestRestart) -> loop.Event:
        with self._signals.holding():  # a fenced write: a signal must not cut it in half
            self._h.request_restart(action.reason, action.failure)
        return loop.RestartRequested()

    def _barrier(self, action: loop.ExitBarrier) -> loop.Event:
        if action.close:
            self._h.set_closed()
            return loop.BarrierDone(True)
        if self._h.exit_barrier():
            return loop.BarrierDone(True)
        if self._lost():
            return loop.BarrierDone(False, fenced=True)
        return loop.BarrierDone(False, self._h.closed_failure())

    def _fail_remote(self, action: loop.FailWithRemoteRootCause) -> NoReturn:
        f = action.failure
        pf = ProcessFailure(
            local_rank=f.local_rank,
            pid=f.pid,
            exitcode=f.exit_code,
            error_file=self._write_remote_error(f),
            global_rank=f.global_rank,
            host=f.host,
            exit_time=f.timestamp,
            stderr_tail=f.stderr_tail,
        )
        raise ChildFailedError(name=self._spec.get_entrypoint_name(), failures={f.global_rank: pf})

    def _raise_closed(self, action: loop.RaiseClosed) -> NoReturn:
        assert self._closed_error is not None
        raise self._closed_error

    def _forward(self, action: loop.ForwardSignal) -> None:
        sig = signal.Signals(action.signum)
        result = self._stop_workers(forward=sig)  # run() then re-raises
        self.observer.stopped(result, self._group.workers, f"the agent got {sig.name}")

    # ---- helpers ---------------------------------------------------------------------------
    def _rendezvous(self) -> RendezvousInfo:
        """next_rendezvous() with one status line every few seconds while it waits."""
        done = threading.Event()
        started = time.monotonic()

        def ticker() -> None:
            while not done.wait(self._status_interval):
                call = self._report.last_call()  # the first round's, as every node says it
                if call is not None:
                    log.info("%s", call.line(time.time()))
                    continue
                log.info(
                    "waiting for a round (%.0f s): %s",
                    time.monotonic() - started,
                    self._report.status() or "...",
                )

        th = threading.Thread(target=ticker, name="etcdrun-status", daemon=True)
        th.start()
        try:
            return self._h.next_rendezvous()
        finally:
            done.set()
            th.join()

    def _wait(self) -> loop.Event:
        """Sleep until the workers end or the round is superseded (a signal raises).

        The wake-up is cleared before the state is read, so an exit or a change that lands
        between the read and the sleep still ends the sleep at once.
        """
        changed = self._h.membership_changed
        while True:
            self._wake.clear()
            self._signals.check_deferred()
            if self._drain.pending is not None:  # leaving anyway: no round change matters
                return self._drain.pending
            if changed.is_set() and not self._in_place.finished(self._group):
                if self._lost() or self._liveness.confirm() is Liveness.LOST:
                    return loop.LeaseLost()  # our own lease vanished: fencing, not a change
                paused = self._fencing.paused_at is not None  # a broken world: no grace
                reason = self._report.round_reason()
                kept = self._in_place.ready(self._group, self._spec.local_world_size)
                return loop.RoundSuperseded(reason, paused, in_place=kept)
            if self._fencing.follow():  # the lease in doubt: pause; etcd answered: resume
                return loop.LeaseLost()
            result = self._group.poll()
            if result is not None:
                if result.state == WorkerState.SUCCEEDED:
                    done = self._in_place.done_early(self._group, changed.is_set())
                    return loop.WorkersSucceeded(earlier=done)
                if self._fencing.fenced() or self._lost():
                    return loop.LeaseLost()  # the warden killed them: fencing, not a failure
                return loop.WorkersFailed()
            self._wake.wait()

    def _lost(self) -> bool:
        return self._liveness.read().state is Liveness.LOST

    def _stop_workers(
        self, grace: float | None = None, forward: signal.Signals | None = None
    ) -> RunResult:
        with self._signals.holding():
            if forward is not None:  # torchrun's way: the signal itself, then SIGKILL
                self._fencing.resume(f"got {forward.name}")  # a paused worker must see it
                result = self._group.stop(grace, sig=forward)
            else:
                result = self._group.stop(grace)
            with standby.waiting(self._standbys) as skip:
                left = self._fencing.stopped(skip=skip)
            if left:
                log.info("killed %d process(es) the workers left behind", left)
            return result

    def _write_remote_error(self, f: FailureInfo) -> str:
        """The remote root cause, as an error file in our own log dir (torch's format)."""
        d = os.path.join(self._group.log_root(), self._h.get_run_id() or "run")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"root_cause_rank{f.global_rank}.json")
        write_error_json(path, f.message or f"exit code {f.exit_code}", f.traceback, f.timestamp)
        return path


_PERFORM: dict[type, Any] = {
    loop.Join: ElasticAgent._join,
    loop.StartWorkers: ElasticAgent._start,
    loop.Regroup: ElasticAgent._regroup,
    loop.HandOver: ElasticAgent._hand_over,
    loop.StopWorkers: ElasticAgent._stop,
    loop.RequestRestart: ElasticAgent._restart,
    loop.ExitBarrier: ElasticAgent._barrier,
    loop.FailWithRemoteRootCause: ElasticAgent._fail_remote,
    loop.RaiseClosed: ElasticAgent._raise_closed,
    loop.ForwardSignal: ElasticAgent._forward,
}


# torch's (and the reference launcher's) name for the same agent.
LocalElasticAgent = ElasticAgent
