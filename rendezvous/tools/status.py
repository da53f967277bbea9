"""A run as etcd holds it, read in one transaction: what ``etcdrun status`` shows.

Why from etcd alone: when a 64-node job stalls at 2 a.m., the operator may be on none of its
nodes, and the agents may be the thing that is stuck. Everything that decides a round is in
etcd — the agent keys (who is alive, and how long their leases have left), the round key (its
number, phase, participants, why it opened, how the run ended) and the join records — so one
consistent read answers "which node is missing, which round, why did it restart". The values
are protobuf (``etcdctl get`` shows bytes): this module is the readable view of them.

The JSON form (``RunStatus.to_json``) is versioned (``schema``) and documented in
docs/status.md; scripts may rely on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import KeptRound
from etcdrun.rendezvous.client import EtcdClient, EtcdError
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.errors import RendezvousError
from etcdrun.rendezvous.etcd.core import codec, shards
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Sharded
from etcdrun.rendezvous.etcd.core.stragglers import Pace, judge
from etcdrun.rendezvous.etcd.node import cooldown
from etcdrun.rendezvous.etcd.node.node_names import node_name

SCHEMA = 1


@dataclass(frozen=True)
class Node:
    node_id: str
    host: str = ""
    addr: str = ""
    pid: int = 0
    local_world_size: int = 0
    lease_ttl_left: int | None = None  # seconds; None: no live agent key (the node is gone)
    node_rank: int | None = None  # in the current frozen round
    joined: bool = False  # has a join record for the current round
    version: str = ""
    # True: its agent key lives, and its lease was renewed since etcd's leader last changed;
    # False: gone; None: cannot be told (its lease did not answer, or etcd restarted or changed
    # leader, which renews every lease, and this agent has not renewed its own since)
    alive: bool | None = True


@dataclass(frozen=True)
class Cooldown:
    """A node's bad-host cooldown record (rendezvous/etcd/node/cooldown.py), by node name."""

    node: str  # the node id without its incarnation
    node_id: str  # the incarnation that wrote the record last
    resting: bool  # sits rounds out now
    failures: int  # worker failures charged to it since its last cooldown
    cooldowns: int  # cooldowns so far (the next one lasts twice as long, up to the cap)
    until_unix: float  # the node's clock: when its current or last cooldown ends
    seconds_left: float  # resting: until_unix less this reader's clock, at least 0
    why: str  # the last failure charged to it


@dataclass(frozen=True)
class NodePace:
    """A node's published pace (rendezvous/etcd/core/stragglers.py) and how it compares."""

    node_id: str
    round: int  # the round it was measured in
    step: int  # its slowest worker's last step
    step_rate: float  # steps per wall second
    rate: float  # steps per CPU-second of its slowest worker: what names a straggler
    lag: int  # the newest step of the round's nodes less this node's
    straggler: bool  # rate below straggler_fraction of the round's median
    age_s: float  # since it was measured (the node's clock against the reader's)


@dataclass(frozen=True)
class RootCause:
    node_id: str
    host: str
    global_rank: int
    local_rank: int
    exit_code: int
    signal: str
    message: str
    traceback: str
    time_unix_ms: int


@dataclass(frozen=True)
class RunStatus:
    """One run at one etcd revision."""

    run_id: str
    prefix: str
    revision: int
    exists: bool
    round: int | None = None
    phase: str | None = None  # JOINING | FROZEN | CLOSED
    reason: str = ""  # why this round opened
    decided_by: str = ""
    restart_count: int = 0
    max_restarts: int | None = None  # the job's settings, as its oldest agent published them
    min_nodes: int | None = None
    max_nodes: int | None = None
    world_size: int = 0
    master_addr: str = ""
    master_port: int = 0
    participants: tuple[Node, ...] = ()  # the frozen round's nodes, by node rank
    previous: tuple[Node, ...] = ()  # JOINING: the last round's survivors, in their order (S6)
    departed: tuple[str, ...] = ()  # the nodes whose leaving opened this round
    departed_cause: tuple[str, ...] = ()  # for each: "lease expired", "left" or "gone"
    arrived: tuple[str, ...] = ()  # the newcomers that opened it
    last_call_deadline_unix_ms: int = 0  # JOINING, first round: the leader's last call
    last_call_joined: int = 0
    missing: tuple[str, ...] = ()  # nodes of the run whose agent is gone: lost
    # missing node id -> the live node id of the same agent, registered again (a new incarnation
    # after its lease was lost): the process lives on, the old place in the round is gone
    rejoined: dict[str, str] = field(default_factory=dict)
    waiting: tuple[Node, ...] = ()  # live agents outside the frozen round (newcomers, spares)
    joining: tuple[Node, ...] = ()  # JOINING: live agents, with whether each has joined
    outcome: str | None = None  # CLOSED: SUCCEEDED | FAILED
    closed_unix_ms: int = 0
    root_cause: RootCause | None = None
    unreadable: tuple[str, ...] = ()  # keys of the run that do not decode (reported, skipped)
    cooldowns: tuple[Cooldown, ...] = ()  # nodes charged with worker failures, resting or not
    kept_rounds: tuple[KeptRound, ...] = ()  # the last rounds taken in place, oldest first
    paces: tuple[NodePace, ...] = ()  # each node's published pace, by node id
    median_rate: float | None = None  # of the current round's paces (None: fewer than 3)
    straggler_fraction: float = 0.5  # the reader's setting (--rdzv-conf straggler_fraction)
    read_unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    @property
    def state(self) -> str:
        """What people ask of a job, in their words (``phase`` is the protocol's): running,
        forming, waiting for nodes, finished, failed, cancelled; unknown while the nodes'
        liveness cannot be read. Why not the phase: a healthy running job showed "FROZEN",
        the word the docs use for a stopped node.
        """
        if not self.exists:
            return "unknown"
        if self.phase == "CLOSED":
            words = {"SUCCEEDED": "finished", "FAILED": "failed", "CANCELLED": "cancelled"}
            return words.get(self.outcome or "", "finished")
        if self.round is None:
            return "forming"
        if self.phase == "JOINING":
            if any(n.alive is None for n in self.joining):
                return "unknown"
            live = len(self.joining)
            short = self.min_nodes is not None and live < self.min_nodes
            return "waiting for nodes" if short else "forming"
        left = [n for n in self.participants if n.node_id not in self.missing]
        if self.missing:
            live = len(left) + len(self.waiting)
            short = self.min_nodes is not None and live < self.min_nodes
            return "waiting for nodes" if short else "forming"
        if any(n.alive is None for n in left):
            return "unknown"  # alive or not, nobody can say yet (``Node.alive``)
        return "running"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["schema"] = SCHEMA
        out["state"] = self.state
        return out


def read(
    client: EtcdClient, keys: RunKeys, *, ttls: bool = True, fraction: float = 0.5
) -> RunStatus:
    """The run's state in one transaction (plus one LeaseTimeToLive per agent with ``ttls``);
    ``fraction`` is the straggler rule's (the job's ``straggler_fraction``).
    """
    res = client.txn(
        [],
        [
            t.get(keys.agents, prefix=True),
            t.get(keys.round),
            t.get(keys.rounds, prefix=True),
            t.get(keys.cooldowns, prefix=True),
            t.get(keys.kept_rounds, prefix=True),
            t.get(keys.paces, prefix=True),
            t.get(keys.lease_terms, prefix=True),
        ],
    )
    kvs = [r.response_range.kvs for r in res.responses]
    stale = _not_renewed(keys, kvs[6], res.term)
    got = _read(client, keys, res.revision, *kvs[:3], ttls=ttls, stale=stale)
    got = replace(got, rejoined=_rejoined(got))
    bad: list[str] = []
    cooled = _cooldowns(keys, kvs[3], bad, time.time())
    kept = _kept(kvs[4], bad)
    paces = {kv.key.decode(errors="replace"): Pace.decode(kv.value) for kv in kvs[5]}
    bad += [key for key, p in paces.items() if p is None]
    known = [p for p in paces.values() if p is not None]
    rows, median = _paces(known, got.round, fraction, time.time())
    return replace(
        got,
        cooldowns=cooled,
        kept_rounds=kept,
        unreadable=(*got.unreadable, *bad),
        paces=rows,
        median_rate=median,
        straggler_fraction=fraction,
    )


def _rejoined(s: RunStatus) -> dict[str, str]:
    """Each missing node whose agent registered again under a new incarnation (node_name: the
    node id without ``.<incarnation>``), and the id it lives under now.
    """
    nodes = (*s.participants, *s.waiting, *s.joining)
    live = {node_name(n.node_id): n.node_id for n in nodes if n.node_id not in s.missing}
    return {m: live[node_name(m)] for m in s.missing if node_name(m) in live}


def _not_renewed(keys: RunKeys, kvs, term: int) -> frozenset[str]:
    """The agents whose term mark (session.py) is older than the term this read was answered
    in: etcd's new leader renewed their leases, they have not since. An agent without a mark
    (an older etcdrun) or a mark that does not parse is judged by its lease alone, as before.
    """
    out = set()
    for kv in kvs:
        try:
            marked = int(kv.value)
        except ValueError:
            continue
        if 0 < marked < term:
            out.add(kv.key.decode(errors="replace")[len(keys.lease_terms) :])
    return frozenset(out)


def _kept(kvs, unreadable: list[str]) -> tuple[KeptRound, ...]:
    """The rounds taken in place (rendezvous/etcd/ports/report.py writes them), in key order: by
    round number.
    """
    out = []
    for kv in kvs:
        try:
            out.append(KeptRound(**json.loads(kv.value)))
        except (ValueError, TypeError):
            unreadable.append(kv.key.decode(errors="replace"))
    return tuple(out)


def _paces(
    paces: list[Pace], number: int | None, fraction: float, now: float
) -> tuple[tuple[NodePace, ...], float | None]:
    """Each pace, judged among the current round's (design.md §4d: the leader's rule); a
    record of an earlier round (a node that has not published in this one) is shown, with its
    lag behind the current round's newest step, and judged with no one.
    """
    current = [p for p in paces if number is None or p.round == number]
    verdict = judge(current, fraction)
    newest = max((p.step for p in current), default=0)
    rows = tuple(
        NodePace(
            p.node,
            p.round,
            p.step,
            p.step_rate,
            p.rate,
            verdict.lag.get(p.node, max(0, newest - p.step)),
            p.node in verdict.stragglers,
            round(max(0.0, now - p.at_unix_ms / 1000), 1),
        )
        for p in sorted(paces, key=lambda p: p.node)
    )
    return rows, verdict.median


def _cooldowns(keys: RunKeys, kvs, unreadable: list[str], now: float) -> tuple[Cooldown, ...]:
    out = []
    for kv in kvs:
        try:
            rec = cooldown.decode(kv.key, kv.value, keys.run_id)
        except RendezvousError:
            unreadable.append(kv.key.decode(errors="replace"))
            continue
        left = max(0.0, rec.until_unix - now) if rec.resting else 0.0
        name = keys.parse(kv.key)[2] or ""
        out.append(
            Cooldown(
                name,
                rec.node,
                rec.resting,
                rec.failures,
                rec.cooldowns,
                rec.until_unix,
                round(left, 1),
                rec.why,
            )
        )
    return tuple(out)


def _read(
    client: EtcdClient,
    keys: RunKeys,
    revision: int,
    agents_kvs,
    round_kvs,
    rounds_kvs,
    *,
    ttls: bool,
    stale: frozenset[str] = frozenset(),
) -> RunStatus:
    """The run without its cooldowns: agents (``stale``: not renewed since etcd's leader
    changed), round key, rounds/.
    """
    base = dict(run_id=keys.run_id, prefix=keys.root, revision=revision)
    if not agents_kvs and not round_kvs and not rounds_kvs:
        return RunStatus(exists=False, **base)
    unreadable: list[str] = []
    agents = _agents(client, keys, agents_kvs, unreadable, ttls, stale)
    joined = {keys.parse(kv.key)[2] for kv in rounds_kvs if keys.parse(kv.key)[0] == "join"}
    hints = {keys.parse(kv.key)[1]: kv for kv in rounds_kvs if keys.parse(kv.key)[0] == "hint"}
    msg = _round_message(keys, round_kvs, unreadable)
    if msg is not None and msg.shards:
        msg = _unsharded(keys, msg, rounds_kvs, unreadable)
    settings = _settings(agents_kvs, keys)
    if msg is None:
        return RunStatus(exists=True, unreadable=tuple(unreadable), **settings, **base)
    previous: tuple = ()
    hint = hints.get(msg.number) if msg.phase == st.JOINING else None
    if hint is not None:
        try:
            previous = codec.hint_from(hint.key, hint.value, keys.run_id)
        except RendezvousError:
            unreadable.append(hint.key.decode(errors="replace"))
    return _with_round(base, msg, agents, joined, settings, tuple(unreadable), previous)


def _agents(
    client, keys, kvs, unreadable: list[str], ttls: bool, stale: frozenset[str]
) -> dict[str, Node]:
    out: dict[str, Node] = {}
    for kv in sorted(kvs, key=lambda kv: kv.create_revision):
        try:
            info = codec.agent_info(kv.key, kv.value, keys.run_id, kv.lease)
        except RendezvousError:
            unreadable.append(kv.key.decode(errors="replace"))
            continue
        left = None
        if ttls:
            try:
                left = int(client.lease_ttl(kv.lease).TTL)
            except EtcdError:
                left = None
        told = not (ttls and left is None) and info.node_id not in stale
        out[info.node_id] = Node(
            info.node_id,
            info.host,
            info.addr,
            info.pid,
            info.local_world_size,
            left,
            version=info.version,
            alive=True if told else None,
        )
    return out


def _round_message(keys: RunKeys, kvs, unreadable: list[str]) -> st.RoundState | None:
    if not kvs:
        return None
    try:
        return codec.round_message(kvs[0].value, keys.round, keys.run_id)
    except RendezvousError:
        unreadable.append(keys.round)
        return None


def _unsharded(keys: RunKeys, msg: st.RoundState, kvs, unreadable: list[str]) -> st.RoundState:
    """A sharded round's header with its participants from the shard keys (read in the same
    transaction: only the Txn that froze a sharded round writes them, so while the header is
    that round's they hold it). Shards that do not make the round the header says leave it
    without participants, named unreadable.
    """
    got: dict[int, list[st.Participant]] = {}
    for kv in kvs:
        kind, _, i = keys.parse(kv.key)
        if kind != "shard" or i is None or not i.isdigit():
            continue
        try:
            got[int(i)] = list(
                codec.shard_message(kv.key, kv.value, msg.number, keys.run_id).participants
            )
        except RendezvousError:
            unreadable.append(kv.key.decode(errors="replace"))
    if not got and msg.phase == st.CLOSED:  # the last agent out removed them: nothing to show
        return msg
    if shards.problems(Sharded(msg.shards, msg.node_count, msg.world_size), got):
        unreadable.append(keys.shards)
        return msg
    out = st.RoundState()
    out.CopyFrom(msg)
    out.participants.extend(sorted((p for ps in got.values() for p in ps), key=_rank))
    return out


def _rank(p: st.Participant) -> int:
    return p.node_rank


def _settings(kvs, keys: RunKeys) -> dict[str, int | None]:
    """The job's settings from its oldest agent that published them."""
    for kv in sorted(kvs, key=lambda kv: kv.create_revision):
        try:
            info = codec.agent_info(kv.key, kv.value, keys.run_id, kv.lease)
        except RendezvousError:
            continue
        if info.max_nodes:
            return dict(
                min_nodes=info.min_nodes, max_nodes=info.max_nodes, max_restarts=info.max_restarts
            )
    return dict(min_nodes=None, max_nodes=None, max_restarts=None)


def _with_round(
    base, msg: st.RoundState, agents, joined, settings, unreadable, previous
) -> RunStatus:
    phase = st.Phase.Name(msg.phase)
    members = {p.node_id: p for p in msg.participants}
    participants = tuple(_node(agents.get(p.node_id), p) for p in msg.participants)
    before = tuple(_node(agents.get(m.node_id), m) for m in previous)
    frozen = phase == "FROZEN"
    waiting = tuple(n for n in agents.values() if frozen and n.node_id not in members)
    joining = tuple(
        _replace(n, joined=n.node_id in joined) for n in agents.values() if phase == "JOINING"
    )
    cause = _root_cause(msg) if msg.HasField("failure") else None
    return RunStatus(
        exists=True,
        round=msg.number,
        phase=phase,
        reason=msg.reason,
        decided_by=msg.decided_by,
        restart_count=msg.restart_count,
        world_size=msg.world_size or sum(n.local_world_size for n in participants),
        master_addr=msg.master_addr,
        master_port=msg.master_port,
        participants=participants,
        previous=before,
        departed=tuple(msg.departed),
        departed_cause=tuple(msg.departed_cause),
        arrived=tuple(msg.arrived),
        last_call_deadline_unix_ms=msg.last_call_deadline_unix_ms,
        last_call_joined=msg.last_call_joined,
        # a closed run's nodes have left: finished, not missing (a new user was told MISSING)
        missing=()
        if phase == "CLOSED"
        else tuple(n.node_id for n in participants if n.node_id not in agents)
        + tuple(d for d in msg.departed if d not in agents and phase == "JOINING"),
        waiting=waiting,
        joining=joining,
        outcome=st.Outcome.Name(msg.outcome) if phase == "CLOSED" and msg.outcome else None,
        closed_unix_ms=msg.closed_unix_ms,
        root_cause=cause,
        unreadable=unreadable,
        **settings,
        **base,
    )


def _node(live: Node | None, p: Any) -> Node:
    """A node of a round (``p``: a Participant message or Member), live or as remembered."""
    if live is None:  # the node is gone: what the round remembers of it
        return Node(
            p.node_id,
            p.host,
            p.addr,
            p.pid,
            p.local_world_size,
            node_rank=p.node_rank,
            alive=False,
        )
    return _replace(live, node_rank=p.node_rank)


def _replace(n: Node, **kw: Any) -> Node:
    return Node(**{**asdict(n), **kw})


def _root_cause(msg: st.RoundState) -> RootCause:
    f = msg.failure
    return RootCause(
        f.node_id,
        f.host,
        f.global_rank,
        f.local_rank,
        f.exit_code,
        f.signal_name,
        f.message,
        f.traceback,
        f.timestamp_ms,
    )


__all__ = ["Cooldown", "Node", "RootCause", "RunStatus", "SCHEMA", "read"]
