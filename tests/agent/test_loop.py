"""agent/loop.py's ``next_step``: every (phase, event) pair, and the paths a job takes.

No processes, no etcd, no signals: the decisions are a pure function of frozen values, as
rendezvous/etcd/core/protocol.py's ``decide`` is (tests/rendezvous/etcd/test_protocol.py). The
driver's side — that the actions really happen — is tests/agent/test_agent_e2e.py's and
tests/agent/test_agent_loop.py's.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from dataclasses import replace

import pytest

from etcdrun.agent import loop
from etcdrun.agent.api import RunResult, WorkerState
from etcdrun.agent.errors import ProcessFailure
from etcdrun.agent.loop import Phase, State, Then, next_step
from etcdrun.rendezvous.api import FailureInfo, RendezvousInfo


def info(round: int = 3, node_id: str = "n1", restarts: int = 1) -> RendezvousInfo:
    return RendezvousInfo(
        run_id="job",
        round=round,
        node_id=node_id,
        node_rank=0,
        node_count=2,
        first_global_rank=0,
        world_size=4,
        master_addr="10.0.0.1",
        master_port=29500,
        restart_count=restarts,
        max_restarts=2,
    )


def failed_result() -> RunResult:
    def pf(rank: int, code: int, t: float, stopped: bool = False) -> ProcessFailure:
        f = ProcessFailure(
            local_rank=rank, pid=100 + rank, exitcode=code, global_rank=rank, host="h", exit_time=t
        )
        f.stopped_by_agent, f.stop_signal = stopped, ("SIGTERM" if stopped else None)
        return f

    # Rank 0 was stopped by the agent first; rank 1 failed by itself: the root cause.
    return RunResult(WorkerState.FAILED, failures={0: pf(0, -15, 1.0, True), 1: pf(1, 3, 2.0)})


OK = RunResult(WorkerState.SUCCEEDED, return_values={0: None, 1: None})
PEER = FailureInfo(node_id="n2", host="other", global_rank=3, exit_code=1, message="boom")


def walk(state: State, *events: loop.Event) -> list[loop.Step]:
    steps = []
    for event in events:
        step = next_step(state, event)
        steps.append(step)
        state = step.state
    return steps


# ---- the paths --------------------------------------------------------------------------------
def test_success_stops_then_waits_at_the_barrier_then_returns():
    i = info()
    steps = walk(
        State(),
        loop.Joined(i),
        loop.WorkersSucceeded(),
        loop.WorkersStopped(OK),
        loop.BarrierDone(True),
    )
    actions = [s.action for s in steps]
    assert actions[0] == loop.StartWorkers(i)
    assert actions[1] == loop.StopWorkers(grace=None)
    assert isinstance(actions[2], loop.ExitBarrier)
    assert actions[2].note == "round 3: workers succeeded; waiting for the other nodes"
    assert actions[3] == loop.ReturnResult(OK, note="round 3: the job SUCCEEDED")
    assert steps[-1].state.phase is Phase.DONE


def test_barrier_timeout_returns_with_a_warning_or_fails_with_the_remote_cause():
    at_barrier = walk(
        State(), loop.Joined(info()), loop.WorkersSucceeded(), loop.WorkersStopped(OK)
    )[-1].state
    late = next_step(at_barrier, loop.BarrierDone(False)).action
    assert isinstance(late, loop.ReturnResult) and late.result is OK
    assert late.level == logging.WARNING and "not every node finished" in late.note
    failed = next_step(at_barrier, loop.BarrierDone(False, PEER)).action
    assert failed == loop.FailWithRemoteRootCause(PEER)


def test_a_success_after_our_lease_was_lost_rejoins_instead_of_ending():
    """Soak seed 1579: a whole node frozen past its TTL; at the thaw its worker ended 0 before its
    warden killed it, and the agent went to the barrier with a lease etcd no longer had (exit 1).
    The others had gone on in a newer round: that success ends nothing.
    """
    at_barrier = walk(
        State(), loop.Joined(info()), loop.WorkersSucceeded(), loop.WorkersStopped(OK)
    )[-1].state
    step = next_step(at_barrier, loop.BarrierDone(False, fenced=True))
    assert isinstance(step.action, loop.Join) and step.state.phase is Phase.JOINING
    assert step.action.level == logging.WARNING and "lease was lost first" in step.action.note
    assert step.state.result is None


def test_failure_reports_the_root_cause_and_asks_for_a_restart():
    i, result = info(), failed_result()
    steps = walk(State(), loop.Joined(i), loop.WorkersFailed(), loop.WorkersStopped(result))
    assert steps[1].action == loop.StopWorkers(restart=True)  # the rest of a failed world
    ask = steps[-1].action
    assert isinstance(ask, loop.RequestRestart) and ask.level == logging.WARNING
    assert ask.reason == "worker rank 1 on h failed (exit code 3)"
    assert ask.note == (
        "round 3: worker rank 1 on h failed (exit code 3); asking the rendezvous for a new "
        "round (restarts used 1 of 2: 1 left)"
    )
    assert (ask.failure.node_id, ask.failure.global_rank, ask.failure.exit_code) == ("n1", 1, 3)
    assert steps[-1].state.our_failure == ("n1", result)
    rejoin = next_step(steps[-1].state, loop.RestartRequested())
    assert rejoin.action == loop.Join() and rejoin.state.phase is Phase.JOINING
    spent = walk(
        State(), loop.Joined(info(restarts=2)), loop.WorkersFailed(), loop.WorkersStopped(result)
    )[-1].action
    assert spent.note == (
        "round 3: worker rank 1 on h failed (exit code 3); the restart budget is spent (2 of 2 "
        "used): the job fails unless a lost node caused this failure"
    )


def test_a_single_node_does_not_say_it_waits_for_other_nodes():
    alone = replace(info(), node_count=1)
    steps = walk(State(), loop.Joined(alone), loop.WorkersSucceeded(), loop.WorkersStopped(OK))
    assert steps[-1].action.note == "round 3: workers succeeded"


def test_the_run_closed_by_our_failure_returns_our_result():
    result = failed_result()
    state = walk(
        State(),
        loop.Joined(info()),
        loop.WorkersFailed(),
        loop.WorkersStopped(result),
        loop.RestartRequested(),
    )[-1].state
    mine = dataclasses.replace(PEER, node_id="n1")
    done = next_step(state, loop.RunClosed(mine))
    assert done.action == loop.ReturnResult(
        result, note="the restart budget is spent: the job failed", level=logging.ERROR
    )
    # Closed by another node's failure: its root cause, not our result.
    assert next_step(state, loop.RunClosed(PEER)).action == loop.FailWithRemoteRootCause(PEER)


def test_the_run_closed_without_a_failure_raises_the_closed_error():
    step = next_step(State(), loop.RunClosed(None))
    assert step.action == loop.RaiseClosed() and step.state.phase is Phase.DONE


def test_closed_by_a_failure_before_we_ever_failed_is_remote():
    assert next_step(State(), loop.RunClosed(PEER)).action == loop.FailWithRemoteRootCause(PEER)


def test_superseded_round_stops_with_the_restart_grace_and_rejoins():
    steps = walk(
        State(),
        loop.Joined(info()),
        loop.RoundSuperseded("node(s) left: n2"),
        loop.WorkersStopped(OK),
    )
    assert steps[1].action == loop.StopWorkers(restart=True)  # a broken world: the short grace
    assert steps[1].state.then is Then.REJOIN
    assert steps[2].action == loop.Join(
        note="round 3 superseded (node(s) left: n2): restarting workers"
    )
    assert steps[2].state.phase is Phase.JOINING


def test_superseded_without_a_reason_says_membership_changed():
    steps = walk(State(), loop.Joined(info()), loop.RoundSuperseded(), loop.WorkersStopped(OK))
    assert steps[-1].action.note == "round 3 superseded (membership changed): restarting workers"


def test_lease_lost_stops_at_once():
    steps = walk(State(), loop.Joined(info()), loop.LeaseLost(), loop.WorkersStopped(OK))
    assert steps[1].action == loop.StopWorkers(grace=0.0)
    assert steps[2].action == loop.Join(
        note="round 3: this node's lease was lost: workers killed, rejoining"
    )


def test_workers_killed_by_the_fencing_are_nobodys_failure():
    """Their SIGKILLs are the fencing's (the warden's, or ours): a rejoin, never a restart
    request charged to the job (soak seed 1591 asked for one).
    """
    fenced = failed_result()
    steps = walk(State(), loop.Joined(info()), loop.LeaseLost(), loop.WorkersStopped(fenced))
    assert steps[1].state.then is Then.FENCED  # a value, not the reason's words
    assert isinstance(steps[-1].action, loop.Join) and steps[-1].state.phase is Phase.JOINING


def test_a_superseded_round_whose_reason_reads_lease_lost_is_no_fencing():
    """What the round says is for people: a peer's round opened "lease lost" (a peer's lease)
    stops with the grace, and our workers' failures are still a restart request.
    """
    steps = walk(
        State(),
        loop.Joined(info()),
        loop.RoundSuperseded("lease lost"),
        loop.WorkersStopped(failed_result()),
    )
    assert steps[1].action == loop.StopWorkers(restart=True)
    assert steps[1].state.then is Then.REJOIN
    assert isinstance(steps[-1].action, loop.RequestRestart)


def test_superseded_while_the_run_failed_elsewhere_reports_the_remote_cause():
    steps = walk(
        State(), loop.Joined(info()), loop.RoundSuperseded("x"), loop.WorkersStopped(OK, PEER)
    )
    action = steps[-1].action
    assert action == loop.FailWithRemoteRootCause(
        PEER, note="round 3 superseded (x): restarting workers"
    )


def test_our_failure_is_remembered_across_rounds_and_the_latest_wins():
    first, second = failed_result(), failed_result()
    state = walk(
        State(),
        loop.Joined(info(3)),
        loop.WorkersFailed(),
        loop.WorkersStopped(first),
        loop.RestartRequested(),
        loop.Joined(info(4, restarts=2)),
        loop.RoundSuperseded(),
        loop.WorkersStopped(OK),  # a round superseded in between forgets nothing
        loop.Joined(info(5, restarts=2)),
        loop.WorkersFailed(),
        loop.WorkersStopped(second),
        loop.RestartRequested(),
    )[-1].state
    assert state.our_failure is not None and state.our_failure[1] is second
    mine = dataclasses.replace(PEER, node_id="n1")
    assert next_step(state, loop.RunClosed(mine)).action.result is second


def test_a_new_round_starts_clean():
    state = walk(State(), loop.Joined(info(3)), loop.RoundSuperseded("x"), loop.WorkersStopped(OK))[
        -1
    ].state
    fresh = next_step(state, loop.Joined(info(4))).state
    assert (fresh.info.round, fresh.then, fresh.reason, fresh.result) == (4, None, "", None)


@pytest.mark.parametrize("phase", list(Phase))
def test_a_signal_in_any_phase_is_forwarded(phase):
    step = next_step(State(phase=phase, info=info()), loop.Signal(int(signal.SIGTERM)))
    assert step.action == loop.ForwardSignal(
        int(signal.SIGTERM),
        note="got SIGTERM: forwarding it to the workers and leaving the job",
        level=logging.WARNING,
    )
    assert step.state.phase is Phase.DONE
    assert "signal 77" in next_step(State(), loop.Signal(77)).action.note


# ---- a drain (docs/drain.md) ------------------------------------------------------------------
DRAIN = loop.DrainRequested("etcdrun drain (ops@h, pid 1)", "job", "n1")
DRAINED = (
    "run job round 3: node n1 drained (asked by etcdrun drain (ops@h, pid 1)): its workers "
    "stopped and it left the job; no restart charged"
)


def test_a_drain_while_running_stops_the_workers_normally_then_returns_stopped():
    """A normal stop (the spec's grace, not the restart grace), then the end: no restart
    asked for, no barrier, a result that is no failure (exit 0), one line naming all three.
    """
    i = info()
    steps = walk(State(), loop.Joined(i), DRAIN, loop.WorkersStopped(failed_result()))
    assert steps[1].action == loop.StopWorkers(
        note="asked to drain by etcdrun drain (ops@h, pid 1): stopping the workers"
    )
    assert steps[1].state.then is Then.DRAIN
    end = steps[2]
    assert end.state.phase is Phase.DONE
    assert end.action == loop.ReturnResult(RunResult(WorkerState.STOPPED), note=DRAINED)
    assert not end.action.result.is_failed()
    assert end.state.our_failure is None  # the stopped workers are nobody's failure


def test_a_drain_while_joining_returns_at_once_and_names_run_and_node():
    fresh = next_step(State(), DRAIN)
    assert fresh.state.phase is Phase.DONE
    assert fresh.action.result == RunResult(WorkerState.STOPPED)
    assert fresh.action.note == (
        "run job before its first round: node n1 drained (asked by etcdrun drain "
        "(ops@h, pid 1)): its workers stopped and it left the job; no restart charged"
    )
    rejoining = next_step(State(info=info(round=5)), DRAIN)  # between rounds: none run
    assert rejoining.action.note == DRAINED.replace("round 3", "round 5")


def test_a_drain_while_kept_in_place_stops_the_kept_workers_first():
    kept = State(phase=Phase.JOINING, info=info(), kept=True)
    step = next_step(kept, DRAIN)
    assert isinstance(step.action, loop.StopWorkers) and step.action.grace is None
    assert (step.state.phase, step.state.then, step.state.kept) == (
        Phase.STOPPING,
        Then.DRAIN,
        False,
    )
    end = next_step(step.state, loop.WorkersStopped(OK))
    assert end.action == loop.ReturnResult(RunResult(WorkerState.STOPPED), note=DRAINED)


# ---- exhaustive: exactly these (phase, event) pairs are defined -------------------------------
EVENTS = {
    "Joined": loop.Joined(info()),
    "RunClosed": loop.RunClosed(PEER),
    "WorkersSucceeded": loop.WorkersSucceeded(),
    "WorkersFailed": loop.WorkersFailed(),
    "RoundSuperseded": loop.RoundSuperseded("r"),
    "LeaseLost": loop.LeaseLost(),
    "HandOverFailed": loop.HandOverFailed(),
    "WorkersStopped": loop.WorkersStopped(failed_result()),
    "RestartRequested": loop.RestartRequested(),
    "BarrierDone": loop.BarrierDone(True),
    "Signal": loop.Signal(15),
    "DrainRequested": loop.DrainRequested("etcdrun drain (ops@h, pid 1)", "job", "n1"),
}
DEFINED = {
    Phase.JOINING: {"Joined", "RunClosed", "DrainRequested"},
    Phase.RUNNING: {
        "DrainRequested",
        "WorkersSucceeded",
        "WorkersFailed",
        "RoundSuperseded",
        "LeaseLost",
        "HandOverFailed",
    },
    Phase.STOPPING: {"WorkersStopped"},
    Phase.RESTARTING: {"RestartRequested"},
    Phase.BARRIER: {"BarrierDone"},
    Phase.DONE: set(),
}


def _state_for(phase: Phase, then: Then = Then.RESTART, kept: bool = False) -> State:
    return State(
        phase=phase,
        info=info(),
        then=then,
        result=OK,
        kept=kept,
        next_info=info(round=4),
        closed=loop.RunClosed(PEER),
    )


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("name", list(EVENTS))
def test_every_phase_event_pair(phase, name):
    state = _state_for(phase)
    if name in DEFINED[phase] or name == "Signal":
        step = next_step(state, EVENTS[name])
        assert isinstance(step.action, loop.Action) and isinstance(step.state, State)
        assert state == _state_for(phase)  # the input is left as it was (frozen)
        assert next_step(state, EVENTS[name]) == step  # and the answer is the same every time
    else:
        with pytest.raises(loop.UnexpectedEvent, match=f"{name} while {phase.value}"):
            next_step(state, EVENTS[name])


def test_every_event_and_action_type_is_covered():
    assert set(EVENTS) == {t.__name__ for t in loop.Event.__args__}
    produced = set()
    more = (loop.RunClosed(None), loop.BarrierDone(False), loop.RoundSuperseded(in_place=True))
    for phase, names in DEFINED.items():
        for then in Then:
            for name in [*names, "Signal"]:
                for event in (EVENTS[name], *more):
                    for kept in (False, True):
                        state = _state_for(phase, then, kept)
                        try:
                            produced.add(type(next_step(state, event).action))
                        except loop.UnexpectedEvent:
                            pass
    assert produced == {
        cls for cls in vars(loop).values() if isinstance(cls, type) and issubclass(cls, loop.Action)
    } - {loop.Action}


def test_failure_of_names_the_first_real_failure():
    failure, what = loop.failure_of(info(node_id="nX"), failed_result())
    assert (failure.node_id, failure.global_rank, failure.host, failure.pid) == ("nX", 1, "h", 101)
    assert (failure.exit_code, failure.local_rank, failure.timestamp) == (3, 1, 2.0)
    assert what == "worker rank 1 on h failed (exit code 3)"


def test_a_superseded_round_whose_workers_had_failed_still_reports_the_failure():
    """Its failure may be the root cause (two nodes failing in one round): it used to be dropped
    because the round was superseded first.
    """
    i, result = info(), failed_result()
    steps = walk(
        State(),
        loop.Joined(i),
        loop.RoundSuperseded("node(s) left: n2"),
        loop.WorkersStopped(result),
    )
    ask = steps[-1].action
    assert isinstance(ask, loop.RequestRestart) and ask.failure.global_rank == 1
    quiet = walk(State(), loop.Joined(i), loop.RoundSuperseded("x"), loop.WorkersStopped(OK))
    assert isinstance(quiet[-1].action, loop.Join)  # workers that had not failed: just rejoin


def test_a_round_superseded_while_the_workers_are_paused_kills_them_at_once():
    steps = walk(State(), loop.Joined(info()), loop.RoundSuperseded("x", paused=True))
    assert steps[1].action == loop.StopWorkers(grace=0.0)  # stopped processes ignore SIGTERM


# ---- in place (design.md §4a): workers that opted in are handed the next round -----------------
def test_a_round_change_with_every_worker_opted_in_keeps_them_and_hands_the_next_over():
    steps = walk(
        State(),
        loop.Joined(info()),
        loop.RoundSuperseded("node(s) lost: n2 (lease expired)", in_place=True),
        loop.Joined(info(round=4)),
    )
    assert steps[1].action == loop.Regroup(
        3,
        note="round 3 superseded (node(s) lost: n2 (lease expired)): keeping the workers in place",
    )
    assert steps[1].state.phase is Phase.JOINING and steps[1].state.kept
    assert steps[2].action == loop.HandOver(info(round=4), note="round 4: workers kept in place")
    assert steps[2].state.phase is Phase.RUNNING and not steps[2].state.kept
    assert steps[2].state.info == info(round=4)


def test_a_paused_world_is_never_taken_in_place():
    """Paused workers mean our lease was in doubt: a broken world is stopped at once, kept or
    not, so that no rank of the old round can run beside the new one (S4).
    """
    steps = walk(State(), loop.Joined(info()), loop.RoundSuperseded("x", True, in_place=True))
    assert steps[1].action == loop.StopWorkers(grace=0.0) and not steps[1].state.kept


def test_a_place_lost_while_joining_in_place_stops_the_kept_workers_then_starts_fresh():
    new = info(round=4, node_id="n1.2")  # a new incarnation: the old place was fenced
    steps = walk(
        State(),
        loop.Joined(info()),
        loop.RoundSuperseded("x", in_place=True),
        loop.Joined(new),
        loop.WorkersStopped(OK),
    )
    assert steps[2].action.grace == 0.0 and steps[2].state.then is Then.START
    assert steps[3].action == loop.StartWorkers(new)
    assert steps[3].state.phase is Phase.RUNNING and steps[3].state.info == new


def test_a_run_closed_while_joining_in_place_stops_the_kept_workers_then_reports_it():
    steps = walk(
        State(),
        loop.Joined(info()),
        loop.RoundSuperseded("x", in_place=True),
        loop.RunClosed(PEER),
        loop.WorkersStopped(OK),
    )
    assert steps[2].action == loop.StopWorkers(restart=True)
    assert steps[3].action == loop.FailWithRemoteRootCause(PEER)
    assert steps[3].state.phase is Phase.DONE


def test_a_kept_worker_that_cannot_be_handed_the_round_is_started_afresh_in_it():
    steps = walk(
        State(),
        loop.Joined(info()),
        loop.RoundSuperseded("x", in_place=True),
        loop.Joined(info(round=4)),
        loop.HandOverFailed(),
        loop.WorkersStopped(OK),
    )
    assert steps[3].action.restart and steps[3].state.then is Then.START
    assert steps[4].action == loop.StartWorkers(info(round=4))


def test_kept_workers_that_finished_before_resuming_close_the_run_as_succeeded():
    """Seed 1067 of the in-place soak (bench/results/soak.md): a newcomer arrived as the survivors
    ended their training. Handed the new round, they had already returned: waiting at the exit
    barrier for the newcomer, whose workers wait for a store nobody serves, would hang.
    """
    steps = walk(
        State(),
        loop.Joined(info()),
        loop.RoundSuperseded("node(s) joined: n3", in_place=True),
        loop.Joined(info(round=4)),
        loop.WorkersSucceeded(earlier=True),
        loop.WorkersStopped(OK),
        loop.BarrierDone(True),
    )
    assert steps[4].action == loop.ExitBarrier(
        close=True,
        note="round 4: the kept workers finished the training before they resumed in this "
        "round: closing the run as SUCCEEDED (its newcomers have no one to sync from)",
    )
    assert steps[5].action == loop.ReturnResult(OK, note="round 4: the job SUCCEEDED")


def test_workers_that_succeed_in_their_round_wait_at_the_barrier():
    steps = walk(State(), loop.Joined(info()), loop.WorkersSucceeded(), loop.WorkersStopped(OK))
    assert isinstance(steps[2].action, loop.ExitBarrier) and not steps[2].action.close
