"""The agent's console lines that tell what happened to the job, one line per fact.

Why pure functions of the rounds: every node composes its lines from its own previous round and
the new one's ``RoundCause`` (the leader's decision, the same on every node), so a lost node
reads the same everywhere — ``node 2 (host-b, pid 4711) lost: lease expired; new round 5 with 3
nodes (no restart charged)`` — and the cause of a restart is the round's failure (the earliest,
lifecycle.py), never a worker some agent stopped itself. Before, a killed node showed only as
``worker rank 4 on vm failed (exit code 1); restarting (restarts so far 0/0)``. Tested in
tests/agent/test_story.py without processes, and in the e2e tests by their text.
"""

from __future__ import annotations

from etcdrun.rendezvous.api import (
    DepartureCause,
    FailureInfo,
    Participant,
    RendezvousInfo,
    RoundCause,
)

_GENERIC = ("exited with code", "Signal ")  # ProcessFailure's words when there is no error file


def who(p: Participant | None, node_id: str) -> str:
    """``node 2 (host-b, pid 4711)``: the rank it had, where it ran; its id when unknown."""
    if p is None:
        return f"node {node_id}"
    where = f"{p.host}, pid {p.pid}" if p.host else p.addr
    return f"node {p.node_rank} ({where})"


def failure_text(f: FailureInfo) -> str:
    """``worker rank 3 (local 1) on host-b failed (exit code 1): ValueError: boom``: with the
    error file's message, else the last line the worker wrote on stderr (carried through etcd).
    """
    how = f"killed by {f.signal_name}" if f.signal_name else f"exit code {f.exit_code}"
    text = f"worker rank {f.global_rank} (local {f.local_rank}) on {f.host} failed ({how})"
    said = f.message if f.message and not f.message.startswith(_GENERIC) else ""
    if not said:
        said = next((ln.strip() for ln in reversed(f.stderr_tail) if ln.strip()), "")
    return f"{text}: {said}" if said else text


def why_class(cause: RoundCause | None, lease_lost: bool) -> str:
    """A small set of reasons, for a metric label: first, node_lost, node_left, node_joined,
    worker_failed, lease_lost, other.
    """
    if lease_lost:
        return "lease_lost"
    if cause is None or cause.reason in ("", "first agent"):
        return "first"
    if cause.departed:
        lost = any(d.cause is not DepartureCause.LEFT for d in cause.departed)
        return "node_lost" if lost else "node_left"
    if cause.failure is not None:
        return "worker_failed"
    return "node_joined" if cause.arrived else "other"


def _charge(prev: RendezvousInfo, info: RendezvousInfo) -> str:
    if info.restart_count > prev.restart_count:
        return f"restart {info.restart_count} of {info.max_restarts} charged"
    return "no restart charged"


def round_change(
    prev: RendezvousInfo | None, info: RendezvousInfo, lease_lost: bool = False
) -> str | None:
    """The line for a node starting workers in ``info``'s round after ``prev``'s (None: the
    first round this agent runs in, which the round line says enough about).
    """
    if prev is None:
        return None
    nodes = "node" if info.node_count == 1 else "nodes"
    new = f"new round {info.round} with {info.node_count} {nodes}"
    if info.round == prev.round:  # the static backend: one round, restarted in place
        new = f"the workers restart on {info.node_count} {nodes}"
    if lease_lost:
        return f"this node lost its lease and rejoined as {info.node_id}: {new}"
    cause = info.cause or RoundCause()
    charge = _charge(prev, info)
    before = {p.node_id: p for p in prev.participants}
    now = {p.node_id: p for p in info.participants}
    facts = []
    for d in cause.departed:
        verb = "left" if d.cause is DepartureCause.LEFT else f"lost: {d.cause.value}"
        facts.append(f"{who(before.get(d.node_id), d.node_id)} {verb}")
    if cause.failure is not None and info.restart_count > prev.restart_count:
        facts.append(failure_text(cause.failure))
    for node in cause.arrived:
        if node in now:
            facts.append(f"{who(now[node], node)} joined")
    if not facts:
        same = info.round == prev.round
        facts.append(cause.reason or ("a worker failed" if same else "the round changed"))
    return f"{'; '.join(facts)}; {new} ({charge})"


def logs_line(root: str, run_id: str, given: bool) -> str:
    """Where this agent's logs are, said once when its first workers start (a temporary folder
    without --log-dir: the user must know it goes).
    """
    files = f"events.jsonl; workers' files under {root}/{run_id}/attempt_<n>/"
    if given:
        return f"logs: {root} (agent.log, {files})"
    return (
        f"logs: {root} ({files}); a temporary folder, removed after a successful run unless "
        "worker output goes to files (-r/-t) or a fault left error files or stacks: give "
        "--log-dir to keep it"
    )


def logs_kept(where: str, succeeded: bool) -> str:
    """The agent's last line when its temporary log folder stays: after a failure, or after a
    success that survived faults (their error files and stacks are what it keeps).
    """
    if succeeded:
        return f"the run succeeded; the error files and stacks of its faults are in {where}"
    return f"worker logs and error files are in {where}"


__all__ = ["failure_text", "logs_kept", "logs_line", "round_change", "who", "why_class"]
