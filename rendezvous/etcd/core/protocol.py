"""The rendezvous' decision logic: pure, no I/O, no clock of its own.

Why pure: every rule of the protocol (design.md §3, S1–S6 and L1–L5) lives here and is unit-tested
exhaustively against a fake clock; etcd/handler.py only gathers the inputs from its watch caches
and applies the one transaction an Action names, fenced on the round key's mod_revision.

Only the leader (the oldest live agent) calls ``decide``; the other agents just join rounds and
read the round key. A membership change of a running round is *carried* when it can be
(carry.py, design.md §3a): the next round is frozen at once from the live agent keys, and the
survivors write nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from etcdrun.rendezvous.api import FailureInfo, Participant, check_node_range
from etcdrun.rendezvous.etcd.core import carry

# The rendezvous protocol this code follows (AgentInfo.protocol, RoundState.protocol): 2 can be
# carried into a round without writing (design.md §3a); 4 reads a round whose participants are
# sharded over the run's fixed shard keys (shards.py, design.md §2); 3 read them from keys of
# each round, which sharded rounds no longer write. An older agent publishes none (0).
PROTOCOL = 4
CARRIED = 2  # the least protocol that follows a carried round, and that the leader carries
SHARDED = 4  # the least protocol that reads a sharded round


class Phase(Enum):
    JOINING = 1
    FROZEN = 2
    CLOSED = 3


@dataclass(frozen=True)
class Agent:
    """A live agent (its key exists under agents/, so its lease is alive)."""

    node_id: str
    create_revision: int
    local_world_size: int = 1
    addr: str = ""
    host: str = ""
    pid: int = 0
    protocol: int = 0  # AgentInfo.protocol: below PROTOCOL it is never carried (§3a)
    spare_port: int = 0  # its MASTER_PORT for the next carried round in which it is rank 0

    def member(self) -> Participant:
        """This agent as a newcomer to a carried round (its place and ranks set later)."""
        return Participant(
            self.node_id, 0, self.local_world_size, self.addr, 0, self.host, self.pid
        )


@dataclass(frozen=True)
class Join:
    """A join record of the current round."""

    node_id: str
    local_world_size: int
    addr: str
    master_port: int
    agent_create_revision: int
    host: str = ""
    pid: int = 0


# A participant of a frozen round (or, for a JOINING round, of the previous one: the hint). The
# same class as the API's Participant, so a frozen round's list reaches the agent as it is.
Member = Participant


@dataclass(frozen=True)
class Sharded:
    """What a sharded round's header says of its participants, which it does not list: they
    live in ``shards`` keys (shards.py), ``nodes`` of them with ``world_size`` workers in all.
    """

    shards: int
    nodes: int
    world_size: int


@dataclass(frozen=True)
class Round:
    number: int
    phase: Phase
    members: tuple[Member, ...] = ()  # FROZEN: the participants; JOINING: the previous ones
    restart_count: int = 0
    master_addr: str = ""
    master_port: int = 0
    mod_revision: int = 0
    # JOINING: a worker failure opened this round; the restart is charged at the freeze (or the
    # run closes as failed), unless a previous member is gone — then a death caused it.
    failure: FailureInfo | None = None
    # The lease of the round key and the hints (not of CLOSED: that has its marker), which the
    # leader keeps alive; 0 for a round written by an older etcdrun. Never part of a decision.
    run_lease: int = 0
    # FROZEN straight from the previous FROZEN round (§3a), and for each member of such a round
    # the first global ranks it held since the last gathered round besides its current ones.
    carried: bool = False
    held: tuple[tuple[str, tuple[int, ...]], ...] = ()
    protocol: int = 0  # the lowest agent protocol that can follow it (0: any)
    # FROZEN (and the CLOSED after it) from the shard threshold on: the participants live in
    # shard keys, and ``members`` holds those read so far (none from the round key alone, one
    # shard for a node that read its own, all once ``whole``).
    sharded: Sharded | None = None
    cancelled: bool = False  # CLOSED because every node of it was stopped by a signal

    def member(self, node_id: str) -> Member | None:
        return self._by_node.get(node_id)

    def held_by(self, node_id: str) -> tuple[int, ...]:
        return self._held.get(node_id, ())

    @functools.cached_property
    def _held(self) -> dict[str, tuple[int, ...]]:
        return dict(self.held)

    @functools.cached_property
    def _by_node(self) -> dict[str, Member]:
        """Why an index: a process of the scale bench holds 250 handlers that each look
        themselves up in one shared round of 1,000 members, and the leader's decide() looks up
        every agent: a scan made each of those O(N^2) per process and round.
        """
        by: dict[str, Member] = {}
        for m in self.members:
            by.setdefault(m.node_id, m)  # the first, as a scan would find
        return by

    @functools.cached_property
    def world_size(self) -> int:
        if self.sharded is not None:
            return self.sharded.world_size
        return sum(m.local_world_size for m in self.members)

    def outside(self, live: Iterable[str]) -> int:
        """How many of the ``live`` agents' node ids this round leaves waiting: every one unless
        it is FROZEN. A sharded header lists nobody, so it counts by its size: a member whose
        agent key is gone counts as present until the next round says otherwise.
        """
        nodes = list(live)
        if self.phase is not Phase.FROZEN:
            return len(nodes)
        if not self.whole:
            return max(0, len(nodes) - self.node_count)
        return sum(1 for node in nodes if node not in self._by_node)

    @property
    def node_count(self) -> int:
        return self.sharded.nodes if self.sharded is not None else len(self.members)

    @property
    def whole(self) -> bool:
        """``members`` lists every participant (always, unless sharded)."""
        return self.sharded is None or len(self.members) == self.sharded.nodes


@dataclass(frozen=True)
class Settings:
    min_nodes: int
    max_nodes: int
    last_call_timeout: float = 30.0
    max_restarts: int = 0  # the job-wide budget of worker-failure restarts

    def __post_init__(self) -> None:
        check_node_range(self.min_nodes, self.max_nodes)
        if self.last_call_timeout < 0:
            raise ValueError("last_call_timeout must be >= 0")


@dataclass(frozen=True)
class View:
    """What the leader knows, from its watch caches."""

    round: Round | None
    agents: Mapping[str, Agent]
    joined: Mapping[str, Join] = field(default_factory=dict)  # records of round.number
    last_call_deadline: float | None = None  # leader-local monotonic time, first round only
    # Live agents that sit rounds out (a bad-host cooldown, node/cooldown.py): never waited
    # for, never an arrival; still live, so a restart they caused is charged (``charge``).
    resting: frozenset[str] = frozenset()


# ---- actions ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wait:
    """Nothing to do until the next event (or ``until``, a leader-local monotonic time)."""

    reason: str
    until: float | None = None


@dataclass(frozen=True)
class StartRound:
    """Open round ``number`` for joining; ``hint`` orders survivors (S6)."""

    number: int
    reason: str
    hint: tuple[Member, ...]
    restart_count: int
    departed: tuple[str, ...] = ()  # who left (the reason, as data: etcdrun status reads it)
    arrived: tuple[str, ...] = ()  # who came


@dataclass(frozen=True)
class Freeze:
    """Freeze the current round with these members (ranks assigned, S2)."""

    number: int
    members: tuple[Member, ...]
    master_addr: str
    master_port: int
    restart_count: int = 0


@dataclass(frozen=True)
class CloseFailed:
    """A worker failure with the restart budget spent: the run ends, everywhere, with it."""

    number: int
    failure: FailureInfo
    restart_count: int


@dataclass(frozen=True)
class Carry:
    """Freeze round ``number`` at once from the running round's live members (each keeps its
    place, or fills a departed node's) and the newcomers: nobody writes a join record (§3a).
    """

    number: int
    reason: str
    members: tuple[Member, ...]
    master_addr: str
    master_port: int
    restart_count: int
    held: tuple[tuple[str, tuple[int, ...]], ...] = ()
    departed: tuple[str, ...] = ()
    arrived: tuple[str, ...] = ()


Action = Wait | StartRound | Freeze | CloseFailed | Carry


def is_first_round(r: Round) -> bool:
    """The last-call wait applies only while the job has never run (L1)."""
    return not r.members and r.restart_count == 0


def order(joined: Mapping[str, Join], hint: tuple[Member, ...]) -> list[Join]:
    """Survivors first in their previous rank order, then newcomers by age (S6)."""
    prev = {m.node_id: m.node_rank for m in hint}
    return sorted(
        joined.values(),
        key=lambda j: (prev.get(j.node_id, len(prev)), j.agent_create_revision, j.node_id),
    )


def _all_new(r: Round, agents: Mapping[str, Agent]) -> bool:
    """Every live agent registered after ``r`` last changed (and there is one)."""
    return bool(agents) and all(a.create_revision > r.mod_revision for a in agents.values())


def _abandoned(r: Round, agents: Mapping[str, Agent]) -> bool:
    """``r``'s nodes are all gone and the live agents are a new job's: every one registered
    after ``r`` last changed, and none is a later incarnation of a member (a node id is its
    agent process's name plus ``.<incarnation>``).
    """
    names = {m.node_id.rpartition(".")[0] or m.node_id for m in r.members}
    back = any((a.rpartition(".")[0] or a) in names for a in agents)
    return _all_new(r, agents) and not back


def assign(chosen: list[Join]) -> tuple[Member, ...]:
    """Contiguous node ranks and global ranks (S2)."""
    members, first = [], 0
    for rank, j in enumerate(chosen):
        members.append(Member(j.node_id, rank, j.local_world_size, j.addr, first, j.host, j.pid))
        first += j.local_world_size
    return tuple(members)


FRESH_AFTER_FAILED = "a fresh run after a failed one"
FRESH_AFTER_CANCELLED = "a fresh run after a cancelled one"
FRESH_AFTER_ABANDONED = "a fresh run after an abandoned one"  # (its nodes gone, never closed)


def decide(view: View, settings: Settings, now: float) -> Action:
    """The leader's one decision for the current view."""
    r, agents, rest = view.round, view.agents, view.resting
    if r is None:
        return StartRound(1, "first agent", (), 0)
    if r.phase is Phase.CLOSED:
        # A failed run's id is tried again (a Kubernetes Job retry, a Slurm requeue): a fresh
        # run opens once every live agent came after the close — an agent of the failed run
        # itself must never start it over, or its restart budget would mean nothing.
        if r.failure is not None and _all_new(r, agents):
            return StartRound(r.number + 1, FRESH_AFTER_FAILED, (), 0)
        if r.cancelled and _all_new(r, agents):  # a cancelled job resubmitted, the same way
            return StartRound(r.number + 1, FRESH_AFTER_CANCELLED, (), 0)
        return Wait("run closed")
    if r.phase is Phase.FROZEN:
        if not r.whole:  # a sharded round's header: the caller reads its shards first
            return Wait("reading the round's shards")
        gone = [m.node_id for m in r.members if m.node_id not in agents]
        if len(gone) == len(r.members) and _abandoned(r, agents):
            # Every node of the round is gone and none of the live agents is one of them back
            # (a later incarnation, after its lease was lost) or came before the round last
            # changed: a new job under the id (a requeue after an etcd outage or a kill of
            # every node). It is taken up as a failed run is, with a budget of its own; as
            # "node(s) left", it went on silently as the dead job's next round.
            return StartRound(r.number + 1, FRESH_AFTER_ABANDONED, (), 0)
        waiting = sorted(
            (a for a in agents.values() if r.member(a.node_id) is None and a.node_id not in rest),
            key=lambda a: a.create_revision,
        )
        if gone or (waiting and len(r.members) < settings.max_nodes):
            carried = _carry(r, agents, rest, waiting, tuple(gone), settings)
            if carried is not None:
                return carried
        if gone:
            survivors = tuple(m for m in r.members if m.node_id in agents)
            return StartRound(
                r.number + 1,
                f"node(s) left: {', '.join(gone)}",
                survivors,
                r.restart_count,
                departed=tuple(gone),
            )
        if waiting and len(r.members) < settings.max_nodes:
            return StartRound(
                r.number + 1,
                f"node(s) joined: {', '.join(a.node_id for a in waiting)}",
                r.members,
                r.restart_count,
                arrived=tuple(a.node_id for a in waiting),
            )
        if waiting:
            return Wait(f"{len(waiting)} hot spare(s) waiting for a place")
        return Wait("round running")
    # JOINING
    live = {n: j for n, j in view.joined.items() if n in agents}
    late = [
        m.node_id
        for m in r.members
        if m.node_id in agents and m.node_id not in live and m.node_id not in rest
    ]
    if late:
        # Survivors of the previous round keep their places (S6), even when spares are quicker
        # to join than a survivor is to stop its workers. They are alive: they will come.
        return Wait(f"waiting for survivor(s) {', '.join(late)} to rejoin")
    if len(live) >= settings.max_nodes:
        return _freeze(r, live, settings, agents)
    expected = len(agents) - sum(1 for n in rest if n in agents and n not in live)
    if len(live) >= settings.min_nodes and len(live) == expected:
        if is_first_round(r) and len(agents) < settings.max_nodes:
            deadline = view.last_call_deadline
            if deadline is None:
                deadline = now + settings.last_call_timeout
            if now < deadline:
                return Wait(f"last call: {len(live)}/{settings.max_nodes} nodes", until=deadline)
        return _freeze(r, live, settings, agents)
    return Wait(f"{len(live)}/{max(settings.min_nodes, expected)} nodes joined")


def _carry(
    r: Round,
    agents: Mapping[str, Agent],
    rest: frozenset[str],
    waiting: list[Agent],
    gone: tuple[str, ...],
    settings: Settings,
) -> Carry | Wait | None:
    """The carried round after the FROZEN ``r`` (design.md §3a), a wait for rank 0's next
    master port, or None: the next round gathers as before (StartRound) — when no member is
    left, a survivor is resting or speaks an older protocol, the round would be below min, or
    the carried places would give a node a rank another live node may still hold (S4).
    """
    survivors = [m for m in r.members if m.node_id in agents]
    comers = waiting[: max(0, settings.max_nodes - len(survivors))]
    nodes = [agents[m.node_id] for m in survivors] + comers
    if not survivors or any(m.node_id in rest for m in survivors):
        return None
    if len(nodes) < settings.min_nodes or any(a.protocol < CARRIED for a in nodes):
        return None
    members = carry.place(survivors, [a.member() for a in comers])
    if not carry.handed_over_safely(carry.owned(survivors, r.held_by), members):
        return None
    rank0 = agents[members[0].node_id]
    if not rank0.spare_port:
        return None
    same = r.members[0].node_id == rank0.node_id  # else its port is on another node's host
    if same and rank0.spare_port == r.master_port:  # ran ``r``: rank 0 draws another (§3a)
        return Wait(f"waiting for rank 0 ({rank0.node_id}) to draw its next master port")
    arrived = tuple(a.node_id for a in comers)
    what = [f"node(s) left: {', '.join(gone)}"] if gone else []
    what += [f"node(s) joined: {', '.join(arrived)}"] if arrived else []
    return Carry(
        r.number + 1,
        "; ".join(what),
        members,
        members[0].addr,
        rank0.spare_port,
        r.restart_count,
        carry.held_after(survivors, r.held_by, members),
        gone,
        arrived,
    )


def charge(r: Round, agents: Mapping[str, Agent]) -> int:
    """The restart count of a round about to freeze. A worker failure costs one restart —
    unless a member of the previous round is gone: then its death made the collectives fail,
    and membership changes are free (the failure report races the lease expiry; the freeze
    waits for survivors, so by now the dead are known).
    """
    if r.failure is None or any(m.node_id not in agents for m in r.members):
        return r.restart_count
    return r.restart_count + 1


def _freeze(
    r: Round, live: Mapping[str, Join], settings: Settings, agents: Mapping[str, Agent]
) -> Freeze | CloseFailed:
    count = charge(r, agents)
    if r.failure is not None and count > settings.max_restarts:
        return CloseFailed(r.number, r.failure, r.restart_count)
    chosen = order(live, r.members)[: settings.max_nodes]
    members = assign(chosen)
    return Freeze(r.number, members, members[0].addr, chosen[0].master_port, count)
