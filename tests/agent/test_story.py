"""The console lines that tell the story (agent/report/story.py), from rounds as the rendezvous
gives them: the exact texts the issue asked for, without processes (the e2e tests in
tests/agent/test_observability.py assert the same lines from real agents).
"""

from __future__ import annotations

from etcdrun.agent.report import story
from etcdrun.rendezvous.api import (
    Departure,
    DepartureCause,
    FailureInfo,
    Participant,
    RendezvousInfo,
    RoundCause,
)


def node(rank: int, host: str, pid: int) -> Participant:
    return Participant(f"{host}-{pid:04x}.1", rank, 2, host, 2 * rank, host, pid)


A, B, C, D = node(0, "host-a", 100), node(1, "host-b", 4711), node(2, "host-c", 300), None


def info(number: int, members: tuple[Participant, ...], restarts: int = 0, cause=None, max_r=3):
    return RendezvousInfo(
        "job",
        number,
        members[0].node_id,
        0,
        len(members),
        0,
        2 * len(members),
        "a",
        1,
        restarts,
        members,
        max_r,
        cause,
    )


def test_a_lost_node_in_one_line():
    prev = info(4, (A, B, C, node(3, "host-d", 9)))
    gone = RoundCause("node(s) lost: ...", (Departure(B.node_id, DepartureCause.LEASE_EXPIRED),))
    after = (A, node(1, "host-c", 300), node(2, "host-d", 9))
    line = story.round_change(prev, info(5, after, cause=gone))
    assert line == (
        "node 1 (host-b, pid 4711) lost: lease expired; new round 5 with 3 nodes "
        "(no restart charged)"
    )


def test_a_node_that_left_and_one_that_joined():
    prev = info(2, (A, B))
    left = info(3, (A,), cause=RoundCause("", (Departure(B.node_id, DepartureCause.LEFT),)))
    assert story.round_change(prev, left) == (
        "node 1 (host-b, pid 4711) left; new round 3 with 1 node (no restart charged)"
    )
    newcomer = node(1, "host-e", 55)
    joined = info(4, (A, newcomer), cause=RoundCause("node(s) joined", arrived=(newcomer.node_id,)))
    assert story.round_change(info(3, (A,)), joined) == (
        "node 1 (host-e, pid 55) joined; new round 4 with 2 nodes (no restart charged)"
    )


def test_a_restart_names_the_failure_and_what_the_worker_said_without_record():
    f = FailureInfo(
        B.node_id,
        "host-b",
        3,
        1,
        message="exited with code 1",
        local_rank=1,
        pid=42,
        stderr_tail=("Traceback (most recent call last):", '  File "x.py"', "ValueError: boom"),
    )
    after = info(2, (A, B), restarts=1, cause=RoundCause("worker rank 3 failed", failure=f))
    line = story.round_change(info(1, (A, B)), after)
    assert line == (
        "worker rank 3 (local 1) on host-b failed (exit code 1): ValueError: boom; "
        "new round 2 with 2 nodes (restart 1 of 3 charged)"
    )
    assert "SIGTERM" not in line


def test_a_failure_caused_by_a_death_is_not_the_story():
    """The survivors' collectives broke when B died: the round says B was lost, and charges
    nothing; the consequence is not named as a cause.
    """
    f = FailureInfo(A.node_id, "host-a", 0, 1, message="RuntimeError: gloo", local_rank=0)
    cause = RoundCause(
        "worker rank 0 failed", (Departure(B.node_id, DepartureCause.LEASE_EXPIRED),), (), f
    )
    line = story.round_change(info(1, (A, B)), info(2, (A,), cause=cause))
    assert line == (
        "node 1 (host-b, pid 4711) lost: lease expired; new round 2 with 1 node "
        "(no restart charged)"
    )


def test_our_own_lease_lost_and_the_first_round():
    assert story.round_change(None, info(1, (A,))) is None
    line = story.round_change(info(1, (A, B)), info(2, (A, B)), lease_lost=True)
    assert line == f"this node lost its lease and rejoined as {A.node_id}: new round 2 with 2 nodes"


def test_reasons_for_metrics_are_few():
    lost = RoundCause("x", (Departure("n", DepartureCause.LEASE_EXPIRED),))
    left = RoundCause("x", (Departure("n", DepartureCause.LEFT),))
    failed = RoundCause("x", failure=FailureInfo("n", "h", 1, 1))
    joined = RoundCause("x", arrived=("n",))
    got = [story.why_class(c, False) for c in (None, lost, left, failed, joined)]
    assert got == ["first", "node_lost", "node_left", "worker_failed", "node_joined"]
    assert story.why_class(lost, True) == "lease_lost"


def test_the_static_backend_restarts_in_one_round_and_says_so():
    # Static: the round number never moves; "new round 0" after every restart would mislead.
    line = story.round_change(info(0, (A,)), info(0, (A,), restarts=1))
    assert line == "a worker failed; the workers restart on 1 node (restart 1 of 3 charged)"


def test_a_departure_cause_given_as_a_word_is_taken_as_the_enum():
    """A backend written against rendezvous/api.py alone may give the word etcd keeps."""
    assert Departure("n", "lease expired").cause is DepartureCause.LEASE_EXPIRED
    assert Departure("n", "left").cause is DepartureCause.LEFT
    assert Departure("n", "eaten by a grue").cause is DepartureCause.GONE  # unknown: not seen
