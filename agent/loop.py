"""The elastic agent's decisions as a pure function: ``next_step(state, event) -> (state, action)``.

Why pure, the way rendezvous/etcd/core/protocol.py's ``decide(view, settings, now)`` is: every
path of the loop — a round superseded while workers run, our lease lost, the run closed by our
own failure or by a peer's, an exit barrier that times out on a job that failed elsewhere, a
signal at any point — is decided here from small frozen values and tested exhaustively without
processes, etcd or signals (tests/agent/test_loop.py). elastic_agent.py is the driver: it
performs each action (join, start, stop, ask for a restart, wait at the barrier, raise) and
reports what happened as the next event. It decides nothing.

One attempt goes JOINING → RUNNING → STOPPING → (BARRIER | JOINING), or to DONE after a drain
(the node was asked to leave: docs/drain.md); the workers are always stopped before anything
else happens, because the final result (and so the root cause reported to the rendezvous) is
known only once they are gone. Every decision that involves other nodes
(who is in the round, the restart budget, whether the job failed elsewhere) was already taken by
the rendezvous: the events carry its answers (``closed_failure``), and this function only reads
them.
"""

from __future__ import annotations

import enum
import logging
import signal
from dataclasses import dataclass, replace

from etcdrun.agent.api import RunResult, WorkerState
from etcdrun.agent.errors import root_cause
from etcdrun.rendezvous.api import FailureInfo, RendezvousInfo


class Phase(str, enum.Enum):
    JOINING = "joining"  # next_rendezvous() is running
    RUNNING = "running"  # workers run; waiting for them, the round, or a signal
    STOPPING = "stopping"  # the workers are being stopped (``State.then`` says what follows)
    RESTARTING = "restarting"  # a restart is being requested from the rendezvous
    BARRIER = "barrier"  # our workers succeeded; waiting for the other nodes
    DONE = "done"  # the last action ends the loop


class Then(str, enum.Enum):
    """What follows a stop: the three ways an attempt ends."""

    REJOIN = "rejoin"  # the round was superseded: join the next one
    FENCED = "fenced"  # our place was lost (S4): the workers died at once; join as a new node
    START = "start"  # kept workers were stopped after all: start ``next_info``'s workers
    CLOSED = "closed"  # kept workers were stopped because the run closed: report ``closed``
    RESTART = "restart"  # our workers failed: ask the rendezvous for a restart
    FINISH = "finish"  # our workers succeeded: wait for the other nodes
    DRAIN = "drain"  # this node was asked to leave (docs/drain.md): leave once they are gone


@dataclass(frozen=True)
class State:
    """What the loop remembers between events.

    ``our_failure`` is (node id, result) of the last failure this node reported: when the run
    then closes as failed with that node as the root cause, the agent returns its own result
    (its workers' error files make the report); any other root cause is a peer's.
    """

    phase: Phase = Phase.JOINING
    info: RendezvousInfo | None = None
    then: Then | None = None
    reason: str = ""  # why the round was superseded
    result: RunResult | None = None  # the last attempt's final result, once stopped
    our_failure: tuple[str, RunResult] | None = None
    # In place (design.md §4a): the workers run on while the next round is joined, to be handed
    # it; a round to start, or a closed run to report, once kept workers had to stop after all.
    kept: bool = False
    next_info: RendezvousInfo | None = None
    closed: RunClosed | None = None
    drain: DrainRequested | None = None  # asked to leave: the workers stop, then the agent goes
    done_earlier: bool = False  # kept workers finished before resuming in this round (§4a)


# ---- events: what the driver saw ---------------------------------------------------------------
@dataclass(frozen=True)
class Joined:
    info: RendezvousInfo


@dataclass(frozen=True)
class RunClosed:
    """next_rendezvous() raised RendezvousClosedError; ``failure`` is ``closed_failure()``;
    ``succeeded``: the run this node was part of closed as SUCCEEDED (the error says so).
    """

    failure: FailureInfo | None
    succeeded: bool = False


@dataclass(frozen=True)
class WorkersSucceeded:
    """Every local worker exited 0. ``earlier``: kept workers that were handed this round but
    never resumed in it: their training ended in the round before (design.md §4a).
    """

    earlier: bool = False


@dataclass(frozen=True)
class WorkersFailed:
    """The attempt ended otherwise than in success (a worker failed, or exited interrupted)."""


@dataclass(frozen=True)
class RoundSuperseded:
    reason: str = ""  # the report port's round_reason(), when it has one
    paused: bool = False  # the workers were paused (lease in doubt): kill them, no grace
    in_place: bool = False  # every worker opted in (etcdrun.elastic): keep them for the next


@dataclass(frozen=True)
class HandOverFailed:
    """A kept worker could not be told the new round (its channel broke): start afresh in it."""


@dataclass(frozen=True)
class LeaseLost:
    """Our place in the job is gone (session_lost()): the workers stop at once (fencing, S4)."""


@dataclass(frozen=True)
class WorkersStopped:
    result: RunResult
    closed_failure: FailureInfo | None = None  # read right after the stop


@dataclass(frozen=True)
class RestartRequested:
    pass


@dataclass(frozen=True)
class BarrierDone:
    all_finished: bool
    closed_failure: FailureInfo | None = None  # read when not every node finished
    fenced: bool = False  # our lease was lost first: the others went on in a newer round


@dataclass(frozen=True)
class Signal:
    signum: int


@dataclass(frozen=True)
class DrainRequested:
    """This node is asked to leave the job gracefully (``etcdrun drain``, or SIGTERM while the
    job has more than min nodes). ``run_id`` and ``node_id`` name it in the last line even
    when it never ran a round.
    """

    by: str
    run_id: str = ""
    node_id: str = ""


Event = (
    Joined
    | RunClosed
    | WorkersSucceeded
    | WorkersFailed
    | RoundSuperseded
    | HandOverFailed
    | LeaseLost
    | WorkersStopped
    | RestartRequested
    | BarrierDone
    | Signal
    | DrainRequested
)


# ---- actions: what the driver does next --------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Action:
    """``note`` is a line for the agent's log at ``level``, written before the action runs."""

    note: str = ""
    level: int = logging.INFO


@dataclass(frozen=True)
class Join(Action):
    pass


@dataclass(frozen=True)
class Regroup(Action):
    """Tell the kept workers their round is over (they release their collectives and wait),
    then join the next round, as ``Join`` does.
    """

    round: int


@dataclass(frozen=True)
class StartWorkers(Action):
    info: RendezvousInfo


@dataclass(frozen=True)
class HandOver(Action):
    """Give the kept workers ``info``'s round over the control channel, then wait for them as
    after ``StartWorkers``.
    """

    info: RendezvousInfo


@dataclass(frozen=True)
class StopWorkers(Action):
    grace: float | None = None  # None: the spec's grace (restart_grace if ``restart``); 0: now
    restart: bool = False  # between rounds (a broken world): the short restart grace


@dataclass(frozen=True)
class RequestRestart(Action):
    reason: str
    failure: FailureInfo


@dataclass(frozen=True)
class ExitBarrier(Action):
    """Wait for the other nodes of the round; ``close``: close the run as SUCCEEDED instead,
    without waiting (the work ended in the round before: see ``WorkersSucceeded.earlier``).
    """

    close: bool = False


@dataclass(frozen=True)
class FailWithRemoteRootCause(Action):
    """Raise ChildFailedError naming another node's root cause (written as a local error file)."""

    failure: FailureInfo


@dataclass(frozen=True)
class ReturnResult(Action):
    result: RunResult


@dataclass(frozen=True)
class RaiseClosed(Action):
    """The run closed without a failure to report: the RendezvousClosedError stands."""


@dataclass(frozen=True)
class ForwardSignal(Action):
    """Forward the signal to the workers, stop them, leave, raise SignalException."""

    signum: int


class UnexpectedEvent(RuntimeError):
    """An event the phase cannot produce: a bug in the driver, never a user's mistake."""


@dataclass(frozen=True)
class Step:
    state: State
    action: Action


def failure_of(info: RendezvousInfo, result: RunResult) -> tuple[FailureInfo, str]:
    """The root cause of a failed attempt, as every node will report it, and one line on it."""
    rank, root = root_cause(result.failures)
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
        stderr_tail=tuple(root.stderr_tail),  # through etcd: every node shows what it said
    )
    return failure, f"worker rank {rank} on {root.host} failed ({root.exit_description()})"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def next_step(state: State, event: Event) -> Step:
    """The next state and action after ``event``; UnexpectedEvent for an impossible pair."""
    if isinstance(event, Signal):  # at any point, even while a last action runs
        note = f"got {_signal_name(event.signum)}: forwarding it to the workers and leaving the job"
        return Step(
            replace(state, phase=Phase.DONE),
            ForwardSignal(event.signum, note=note, level=logging.WARNING),
        )
    decide = _BY_PHASE.get(state.phase)
    step = decide(state, event) if decide is not None else None
    if step is None:
        raise UnexpectedEvent(f"{type(event).__name__} while {state.phase.value}")
    return step


def drained_line(state: State, event: DrainRequested) -> str:
    """The drained node's last line: run id, round and node, who asked, and that the job was
    charged nothing (a drain is a departure, never a failure).
    """
    info = state.info
    run_id = info.run_id if info is not None else event.run_id
    node = info.node_id if info is not None else event.node_id
    where = f"round {info.round}" if info is not None else "before its first round"
    return (
        f"run {run_id} {where}: node {node} drained (asked by {event.by}): its workers stopped "
        "and it left the job; no restart charged"
    )


def _drain(state: State, event: DrainRequested) -> Step:
    """Leave with the workers gone: from JOINING at once (none run), else after the stop."""
    if state.phase is Phase.JOINING and not state.kept:
        done = replace(state, phase=Phase.DONE)
        return Step(
            done, ReturnResult(RunResult(WorkerState.STOPPED), note=drained_line(state, event))
        )
    stopping = replace(state, phase=Phase.STOPPING, then=Then.DRAIN, kept=False, drain=event)
    return Step(stopping, StopWorkers(note=f"asked to drain by {event.by}: stopping the workers"))


def _joining(state: State, event: Event) -> Step | None:
    if isinstance(event, DrainRequested):
        return _drain(state, event)
    if state.kept:
        return _joining_kept(state, event)
    if isinstance(event, Joined):
        return Step(
            replace(state, phase=Phase.RUNNING, info=event.info, then=None, reason="", result=None),
            StartWorkers(event.info),
        )
    if not isinstance(event, RunClosed):
        return None
    done = replace(state, phase=Phase.DONE)
    if event.failure is None and event.succeeded:  # a hot spare, or a node rejoining late
        note = "the job finished (SUCCEEDED) without needing this node"
        if state.info is not None:  # we ran workers in it: fenced, the others finished the work
            note = (
                f"the job finished (SUCCEEDED) while this node was out of round {state.info.round}"
            )
        return Step(done, ReturnResult(RunResult(WorkerState.SUCCEEDED), note=note))
    if event.failure is None:
        return Step(done, RaiseClosed())
    ours = state.our_failure
    if ours is not None and event.failure.node_id == ours[0]:
        note = "the restart budget is spent: the job failed"
        return Step(done, ReturnResult(ours[1], note=note, level=logging.ERROR))
    return Step(done, FailWithRemoteRootCause(event.failure))


def _joining_kept(state: State, event: Event) -> Step | None:
    """The workers ran on while this node joined the next round (in place, design.md §4a).
    The same node in the new round: hand it over. A new node (our place was lost meanwhile:
    the warden fenced the workers) or a closed run: the kept workers stop first.
    """
    left = replace(state, kept=False)
    if isinstance(event, Joined):
        prev = state.info
        if prev is not None and event.info.node_id == prev.node_id:
            return Step(
                replace(left, phase=Phase.RUNNING, info=event.info, then=None, reason=""),
                HandOver(event.info, note=f"round {event.info.round}: workers kept in place"),
            )
        note = "this node's place was lost while it joined: the kept workers stop"
        stopping = replace(left, phase=Phase.STOPPING, then=Then.START, next_info=event.info)
        return Step(stopping, StopWorkers(grace=0.0, note=note, level=logging.WARNING))
    if isinstance(event, RunClosed):
        stopping = replace(left, phase=Phase.STOPPING, then=Then.CLOSED, closed=event)
        return Step(stopping, StopWorkers(restart=True))
    return None


def _running(state: State, event: Event) -> Step | None:
    if isinstance(event, DrainRequested):
        return _drain(state, event)
    stopping = replace(state, phase=Phase.STOPPING)
    if isinstance(event, WorkersSucceeded):
        finish = replace(stopping, then=Then.FINISH, done_earlier=event.earlier)
        return Step(finish, StopWorkers())
    if isinstance(event, WorkersFailed):
        return Step(replace(stopping, then=Then.RESTART), StopWorkers(restart=True))
    if isinstance(event, RoundSuperseded):
        reason = event.reason or "membership changed"
        if event.in_place and not event.paused and state.info is not None:
            note = f"round {state.info.round} superseded ({reason}): keeping the workers in place"
            kept = replace(state, phase=Phase.JOINING, kept=True, reason=reason)
            return Step(kept, Regroup(state.info.round, note=note))
        stop = StopWorkers(grace=0.0) if event.paused else StopWorkers(restart=True)
        return Step(replace(stopping, then=Then.REJOIN, reason=reason), stop)
    if isinstance(event, LeaseLost):
        return Step(
            replace(stopping, then=Then.FENCED, reason="lease lost"), StopWorkers(grace=0.0)
        )
    if isinstance(event, HandOverFailed) and state.info is not None:
        note = f"round {state.info.round}: a kept worker could not be handed it: starting afresh"
        again = replace(stopping, then=Then.START, next_info=state.info)
        return Step(again, StopWorkers(restart=True, note=note, level=logging.WARNING))
    return None


def _stopping(state: State, event: Event) -> Step | None:
    if not isinstance(event, WorkersStopped) or state.info is None:
        return None
    info, stopped = state.info, replace(state, result=event.result)
    if state.then is Then.DRAIN and state.drain is not None:  # a departure, never a failure
        done = replace(stopped, phase=Phase.DONE)
        line = drained_line(state, state.drain)
        return Step(done, ReturnResult(RunResult(WorkerState.STOPPED), note=line))
    if state.then is Then.START and state.next_info is not None:  # a new node: fresh workers
        new = state.next_info
        running = replace(stopped, phase=Phase.RUNNING, info=new, next_info=None, then=None)
        return Step(running, StartWorkers(new))
    if state.then is Then.CLOSED and state.closed is not None:  # as a join that found it closed
        return _joining(replace(stopped, phase=Phase.JOINING, closed=None), state.closed)
    if state.then in (Then.REJOIN, Then.FENCED):
        note = f"round {info.round} superseded ({state.reason}): restarting workers"
        if state.then is Then.FENCED:
            note = f"round {info.round}: this node's lease was lost: workers killed, rejoining"
        if event.closed_failure is not None:  # the run failed elsewhere meanwhile
            done = replace(stopped, phase=Phase.DONE)
            return Step(done, FailWithRemoteRootCause(event.closed_failure, note=note))
        # Fenced, the deaths are the fencing's: nobody's failure. Else ours may be the cause.
        if state.then is Then.REJOIN and event.result.real_failures():
            return _restart(stopped, info, event.result)
        return Step(replace(stopped, phase=Phase.JOINING), Join(note=note))
    if state.then is Then.FINISH and state.done_earlier:
        note = (
            f"round {info.round}: the kept workers finished the training before they resumed in "
            "this round: closing the run as SUCCEEDED (its newcomers have no one to sync from)"
        )
        return Step(replace(stopped, phase=Phase.BARRIER), ExitBarrier(close=True, note=note))
    if state.then is Then.FINISH:
        note = f"round {info.round}: workers succeeded"
        if info.node_count > 1:
            note += "; waiting for the other nodes"
        return Step(replace(stopped, phase=Phase.BARRIER), ExitBarrier(note=note))
    if state.then is Then.RESTART:
        return _restart(stopped, info, event.result)
    return None


def _restart(stopped: State, info: RendezvousInfo, result: RunResult) -> Step:
    """One path for every backend: the rendezvous owns the budget. It grants the restart or
    closes the run with this failure (the next join then reports it), and with etcd a failure
    caused by a peer's death costs nothing; a report earlier than the one the next round
    already carries replaces it (the root cause is the first failure, not the first report).
    """
    failure, what = failure_of(info, result)
    left, used = info.max_restarts - info.restart_count, info.restart_count
    note = f"round {info.round}: {what}; " + (
        f"asking the rendezvous for a new round (restarts used {used} of {info.max_restarts}: "
        f"{left} left)"
        if left > 0
        else f"the restart budget is spent ({used} of {info.max_restarts} used): the job fails "
        "unless a lost node caused this failure"
    )
    restarting = replace(stopped, phase=Phase.RESTARTING, our_failure=(info.node_id, result))
    return Step(restarting, RequestRestart(what, failure, note=note, level=logging.WARNING))


def _restarting(state: State, event: Event) -> Step | None:
    if isinstance(event, RestartRequested):
        return Step(replace(state, phase=Phase.JOINING), Join())
    return None


def _barrier(state: State, event: Event) -> Step | None:
    if not isinstance(event, BarrierDone) or state.result is None:
        return None
    done = replace(state, phase=Phase.DONE)
    if event.all_finished:
        n = state.info.round if state.info is not None else "?"
        return Step(done, ReturnResult(state.result, note=f"round {n}: the job SUCCEEDED"))
    if event.fenced:  # a success in a round the others left: not the job's end
        n = state.info.round if state.info is not None else "?"
        note = (
            f"round {n}: workers succeeded, but this node's lease was lost first and the others "
            "went on without it: rejoining as a new node"
        )
        return Step(
            replace(state, phase=Phase.JOINING, result=None), Join(note=note, level=logging.WARNING)
        )
    if event.closed_failure is not None:
        return Step(done, FailWithRemoteRootCause(event.closed_failure))
    note = "not every node finished in time; leaving anyway"
    return Step(done, ReturnResult(state.result, note=note, level=logging.WARNING))


_BY_PHASE = {
    Phase.JOINING: _joining,
    Phase.RUNNING: _running,
    Phase.STOPPING: _stopping,
    Phase.RESTARTING: _restarting,
    Phase.BARRIER: _barrier,
}

__all__ = [
    "Action",
    "BarrierDone",
    "DrainRequested",
    "Event",
    "ExitBarrier",
    "FailWithRemoteRootCause",
    "ForwardSignal",
    "HandOver",
    "HandOverFailed",
    "Join",
    "Joined",
    "LeaseLost",
    "Phase",
    "RaiseClosed",
    "Regroup",
    "RequestRestart",
    "RestartRequested",
    "ReturnResult",
    "RoundSuperseded",
    "RunClosed",
    "Signal",
    "StartWorkers",
    "State",
    "Step",
    "StopWorkers",
    "Then",
    "UnexpectedEvent",
    "WorkersFailed",
    "WorkersStopped",
    "WorkersSucceeded",
    "drained_line",
    "failure_of",
    "next_step",
]
