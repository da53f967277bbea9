"""HangWatchdog: a worker that reports no progress for ``--hang-timeout`` seconds ends its
round, with its stuck frame named on every node (design.md §4b).

The state machine, per round (a new round, or an in-place regroup, starts it afresh)::

    WATCHING --a local rank's last beat is older than S--> post ALARM (the round's first wins)
    any     --ALARM delivered--> DUMPED: every local worker's stack, posted as this node's REPORT
    DUMPED  --all nodes reported, or the wait ran out (alarm node only)--> post VERDICT
    any     --VERDICT delivered--> JUDGED: the line on every node, the stacks in each worker's
                                  error file; the blamed rank's node kills that rank

The kill makes an ordinary worker failure: the agent's loop asks for a restart (or the run
closes when the budget is spent) and every node reports the verdict's line, which the blamed
worker's error file carries. Nothing new in the loop or the rendezvous.

Why not at the job's end: a worker that left its loop (its page says FINISHED at exit) or a
round in which a worker already ended is the agent's to handle, and its peers' slow teardown
is no hang.

Why only ranks that beat once: a worker that never calls ``progress`` or ``commit`` (a script
that did not opt in, one still loading its data) is not watched, so the watchdog never kills a
job that cannot tell it anything. Why the round's start counts as progress: a rank handed a new
round in place may wait for its peers' first collective longer than its last beat is old.

Threads: one of its own (``etcdrun-hang``) that reads the beats a few times a second and
handles the port's notices, which the port's callback only queues. Borrows the agent's worker
group, its hang port and its event log; owns the thread and the subscription.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from etcdrun.agent.hang import stacks
from etcdrun.agent.hang.verdict import Alarm, Verdict, blame
from etcdrun.agent.worker import beat
from etcdrun.agent.worker.error_file import write_error_json
from etcdrun.agent.worker.group import WorkerGroup
from etcdrun.rendezvous.api import HangNotice, HangPort
from etcdrun.rendezvous.events import EventLog

log = logging.getLogger("etcdrun.agent")

DUMP_TIMEOUT = 1.0  # a live worker answers in milliseconds; a stopped one never does
REPORT_WAIT = 1.0  # after the alarm's own dump: what the alarm's node waits for the others


class _Round:
    """What the watchdog knows of one round."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.since_ns = time.monotonic_ns()  # the round's start counts as progress
        self.raised = False  # this node posted an alarm
        self.alarm: Alarm | None = None
        self.reports: dict[str, dict[str, Any]] = {}
        self.stacks: dict[int, stacks.Stack | str] = {}
        self.verdict_due: float | None = None  # the alarm's node: the verdict at the latest
        self.judged = False


class HangWatchdog:
    """``start()`` → ``close()``."""

    def __init__(
        self,
        group: WorkerGroup,
        port: HangPort,
        timeout: float,
        node_id: Callable[[], str | None],
        events: EventLog | None,
        leave: Callable[[], bool] | None = None,
    ) -> None:
        self._group = group
        self._leave = leave
        self._port = port
        self._timeout = timeout
        self._node_id = node_id
        self._events = events
        self._tick = min(0.25, timeout / 8)
        self._notices: queue.SimpleQueue[HangNotice | None] = queue.SimpleQueue()
        self._round: _Round | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="etcdrun-hang", daemon=True)

    def start(self) -> None:
        self._unsubscribe = self._port.subscribe(self._notices.put)
        self._thread.start()

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._notices.put(None)
        if self._thread.is_alive():
            self._thread.join()

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                notice = self._notices.get(timeout=self._tick)
            except queue.Empty:
                notice = False
            if notice is None:
                return
            try:
                if notice:
                    self._on_notice(notice)
                self._check()
            except Exception:  # noqa: BLE001 - a watchdog bug must not end the agent
                log.exception("the hang watchdog failed; it goes on")

    def _current(self) -> _Round | None:
        info = self._group.info
        if info is None or not self._group.workers:
            return None
        if self._round is None or self._round.number != info.round:
            self._round = _Round(info.round)
        return self._round

    def _check(self) -> None:
        rnd = self._current()
        if rnd is None:
            return
        if rnd.verdict_due is not None and time.monotonic() >= rnd.verdict_due:
            self._judge(rnd)
        if rnd.raised or rnd.alarm is not None:
            return
        if not all(w.pid and stacks.alive(w.pid) for w in self._group.workers):
            return  # a worker ended: the agent is on it (a failure, or the job's end)
        now = time.monotonic_ns()
        for rank, files in self._group.log_paths.items():
            b = beat.read(files.progress)
            if b is None or b.step == beat.FINISHED:
                continue
            stalled = (now - max(b.at_ns, rnd.since_ns)) / 1e9
            if stalled > self._timeout:
                self._raise(rnd, rank, stalled, None if b.step < 0 else b.step)
                return

    def _raise(self, rnd: _Round, rank: int, stalled: float, step: int | None) -> None:
        me = self._node_id() or "?"
        rnd.raised = True
        alarm = Alarm(rnd.number, me, rank, stalled, step)
        self._port.post(HangNotice("alarm", rnd.number, me, alarm.body()))

    def _on_notice(self, notice: HangNotice) -> None:
        rnd = self._current()
        if rnd is None or notice.round != rnd.number:
            return  # another round's: that round is over
        if notice.kind == "alarm" and rnd.alarm is None:
            self._on_alarm(rnd, Alarm.of(notice.round, notice.node, notice.body))
        elif notice.kind == "report":
            rnd.reports[notice.node] = dict(notice.body)
            info = self._group.info
            if rnd.verdict_due is not None and info and len(rnd.reports) >= info.node_count:
                self._judge(rnd)
        elif notice.kind == "verdict" and not rnd.judged:
            rnd.judged = True
            self._on_verdict(rnd, Verdict.of(notice.round, notice.body))

    def _on_alarm(self, rnd: _Round, alarm: Alarm) -> None:
        rnd.alarm = alarm
        me = self._node_id() or "?"
        step = "" if alarm.step is None else f" (last step {alarm.step})"
        log.warning(
            "%s: rank %d on node %s made no progress for %.1f s%s: asking every node for its "
            "workers' stacks",
            self._where(rnd),
            alarm.rank,
            alarm.node,
            alarm.stalled_s,
            step,
        )
        self._emit("hang_alarm", rnd, alarm_node=alarm.node, **alarm.body())
        files = self._group.log_paths
        workers = {w.global_rank: (w.pid, files[w.global_rank].stacks) for w in self._group.workers}
        rnd.stacks = stacks.dump({r: pw for r, pw in workers.items() if pw[0]}, DUMP_TIMEOUT)
        report: dict[str, Any] = {"ranks": {}, "silent": {}}
        for rank, got in rnd.stacks.items():
            if isinstance(got, stacks.Stack):
                report["ranks"][str(rank)] = {"where": got.where(), "waiting": got.waiting}
            else:
                report["silent"][str(rank)] = got
        if alarm.node == me:
            rnd.verdict_due = time.monotonic() + REPORT_WAIT
        self._port.post(HangNotice("report", rnd.number, me, report))

    def _judge(self, rnd: _Round) -> None:
        info = self._group.info
        if rnd.alarm is None or rnd.verdict_due is None or info is None:
            return
        rnd.verdict_due = None
        verdict = blame(rnd.alarm, rnd.reports, info.node_count)
        self._port.post(HangNotice("verdict", rnd.number, self._node_id() or "?", verdict.body()))

    def _on_verdict(self, rnd: _Round, verdict: Verdict) -> None:
        me = self._node_id() or "?"
        log.error("%s: hang: %s", self._where(rnd), verdict.line)
        self._emit(
            "hang_verdict", rnd, blamed_node=verdict.node, rank=verdict.rank, where=verdict.where
        )
        self._write_error_file(rnd, verdict)
        if verdict.node != me or not verdict.act:
            return
        # Ask to leave before the kill: the driver then reads the drain ahead of the worker's
        # exit, so the exit is this node's departure, not a failure of the round.
        leaving = self._leave is not None and self._leave()
        victims = [w for w in self._group.workers if verdict.rank in (None, w.global_rank)]
        for w in victims:
            if w.pid:
                try:
                    os.kill(w.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        ranks = [w.global_rank for w in victims]
        self._emit("worker_killed_for_hang", rnd, ranks=ranks, left_in_place=leaving)
        then = (
            "this node leaves the job and the others go on in place"
            if leaving
            else "the round fails with that root cause"
        )
        log.warning(
            "%s: killed rank(s) %s for the hang; %s",
            self._where(rnd),
            ", ".join(map(str, ranks)) or "none",
            then,
        )

    def _write_error_file(self, rnd: _Round, verdict: Verdict) -> None:
        """The blamed worker's error file carries the verdict and its stack, so that every node
        reports them as the round's root cause. The others keep their stacks in their own
        stacks.log only: an error file says that a worker failed by itself (agent/worker/proc.py),
        and a peer that waited in ``all_reduce`` did not.
        """
        got = rnd.stacks.get(verdict.rank) if verdict.rank is not None else None
        files = self._group.log_paths.get(verdict.rank) if verdict.rank is not None else None
        if got is None or files is None or os.path.exists(files.error_file):
            return
        text = got.text if isinstance(got, stacks.Stack) else got
        write_error_json(files.error_file, verdict.line, text, time.time())

    def _where(self, rnd: _Round) -> str:
        info = self._group.info
        run = info.run_id if info is not None else "?"
        return f"run {run} round {rnd.number} node {self._node_id() or '?'}"

    def _emit(self, event: str, rnd: _Round, **details: Any) -> None:
        if self._events is not None:
            self._events.emit(event, round=rnd.number, **details)


__all__ = ["HangWatchdog"]
