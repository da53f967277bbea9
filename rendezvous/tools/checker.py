"""Invariant checker: reads every version of a run's round key from etcd's history and checks
the protocol's safety properties (design.md §3, S1–S6).

Why from etcd's history: it is the ground truth every agent acted on. Watching the round key from
revision 1 replays each state it ever held, in commit order (tests do not compact). Agent-side
facts (which node accepted which round) come from the ``round_accepted`` events the handlers emit.

Carried rounds (design.md §3a: frozen straight from the previous frozen round, nobody joined)
are checked for what they promise instead of a gathering: their members are the previous
round's (less the departed) and the arrivals; survivors keep their places or fill departed
ones; and no global rank goes to a node while another node listed in the new round held it
since the last gathered round (its old workers may still run: S4).

Sharded rounds (design.md §2: the header in the round key, the participants in the run's
shard keys, written by the same Txn, each value naming its round) are put together from the
history of the shard keys, so every check
below reads one shape; the layout itself is checked too (every shard there, each node in the
shard its id hashes to, the header's counts, the protocol it asks of older agents).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core import codec, shards
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import SHARDED, Sharded

Shards = Mapping[int, Mapping[int, st.RoundState]]  # round number -> shard index -> shard


@dataclass(frozen=True)
class Version:
    revision: int
    state: st.RoundState | None  # None: deleted, or unreadable (then ``problem`` says why)
    problem: str | None = None
    layout: tuple[str, ...] = ()  # a sharded round's shards that do not make the round


def round_history(client: EtcdClient, keys: RunKeys, timeout: float = 10.0) -> list[Version]:
    """Every version of the round key up to now, oldest first, each sharded round with its
    participants from its shard keys (one watch of the round key and rounds/, from revision 1).
    """
    kv = client.get(keys.round)
    target = kv.mod_revision if kv is not None else None
    events: list[pb.Event] = []
    last = 0  # the revision of the round key's last event so far
    w = client.watch(keys.round, range_end=t.prefix_end(keys.rounds), start_revision=1)
    try:
        while target is None or last < target:
            # With the key deleted there is no last revision to wait for: stop when idle.
            batch = w.get(timeout=timeout if target is not None else 0.5)
            if batch is None:
                break
            for ev in batch.events:
                kind = keys.parse(ev.kv.key)[0]
                if kind == "round":
                    last = ev.kv.mod_revision
                if kind in ("round", "shard"):
                    events.append(ev)
    finally:
        w.cancel()
    return assemble(events, keys)


def assemble(events: Iterable[pb.Event], keys: RunKeys) -> list[Version]:
    """Versions of the round key from events of the round key and of shard keys, in commit
    order: the shards a Txn wrote are known before the round key it wrote with them.
    """
    shard_keys: dict[int, dict[int, st.RoundState]] = {}
    out: list[Version] = []
    pending: list[pb.Event] = []
    for ev in events:
        if pending and ev.kv.mod_revision != pending[0].kv.mod_revision:
            out += [version(e, keys, shard_keys) for e in pending]
            pending = []
        kind, n, i = keys.parse(ev.kv.key)
        if kind == "round":
            pending.append(ev)
        elif kind == "shard" and ev.type == pb.Event.PUT and i and i.isdigit():
            try:
                got = codec.shard_message(ev.kv.key, ev.kv.value, None, keys.run_id)
            except RendezvousStateError:
                continue  # the round it belongs to reports a shard missing
            shard_keys.setdefault(got.number, {})[int(i)] = got
    return out + [version(e, keys, shard_keys) for e in pending]


def version(ev: pb.Event, keys: RunKeys, shard_keys: Shards | None = None) -> Version:
    """One watch event of the round key as a Version (also for histories kept live); a
    sharded round gets its participants from ``shard_keys``, the shards seen so far.
    """
    if ev.type == pb.Event.DELETE:
        return Version(ev.kv.mod_revision, None)
    try:
        s = codec.round_message(ev.kv.value, keys.round)
    except RendezvousStateError as e:  # garbage someone wrote; the leader restores the state
        return Version(ev.kv.mod_revision, None, e.message)
    if not s.shards or s.phase != st.FROZEN:
        return Version(ev.kv.mod_revision, s)
    return _unsharded(ev.kv.mod_revision, s, (shard_keys or {}).get(s.number, {}))


def _unsharded(revision: int, s: st.RoundState, got: Mapping[int, st.RoundState]) -> Version:
    """The sharded header ``s`` with its shards' participants, and what is wrong with them."""
    parts = {i: list(m.participants) for i, m in got.items()}
    wrong = shards.problems(Sharded(s.shards, s.node_count, s.world_size), parts)
    if s.protocol < SHARDED:
        wrong.append(f"sharded, but asks protocol {s.protocol} of agents: older ones read nobody")
    whole = st.RoundState()
    whole.CopyFrom(s)
    whole.participants.extend(
        sorted((p for ps in parts.values() for p in ps), key=lambda p: p.node_rank)
    )
    return Version(revision, whole, layout=tuple(wrong))


def _same_state(a: st.RoundState, b: st.RoundState) -> bool:
    return (a.number, a.phase, a.restart_count, a.master_addr, a.master_port) == (
        b.number,
        b.phase,
        b.restart_count,
        b.master_addr,
        b.master_port,
    ) and list(a.participants) == list(b.participants)


def check(
    history: list[Version], min_nodes: int, max_nodes: int, accepted: Iterable[Mapping] = ()
) -> list[str]:
    """Return every violation found (empty when the run was safe)."""
    errors: list[str] = []
    frozen: dict[int, st.RoundState] = {}
    prev: st.RoundState | None = None
    prev_frozen: st.RoundState | None = None
    held: dict[str, set[int]] = {}  # node -> first global ranks held since a round gathered
    repairing = False  # the last version was unreadable: the next may restore the state before
    for v in history:
        s = v.state
        if v.problem is not None:
            repairing = True
            continue
        if s is None:
            prev, repairing = None, False
            continue
        if repairing and prev is not None and _same_state(prev, s):
            repairing = False
            continue  # the leader's repair: the same state again, not a new one
        repairing = False
        where = f"round {s.number} @rev {v.revision}"
        if prev is not None and _backwards(prev, s):
            errors.append(
                f"S5 {where}: {st.Phase.Name(s.phase)} after "
                f"round {prev.number} {st.Phase.Name(prev.phase)}"
            )
        if s.phase == st.FROZEN:
            errors += [f"S2 {where}: {p}" for p in v.layout]
            # S1: one frozen participant list per round number.
            if s.number in frozen:
                errors.append(f"S1 {where}: frozen twice")
            frozen[s.number] = s
            errors += _check_frozen(s, where, min_nodes, max_nodes)
            if s.carried:
                errors += _check_carried(prev, s, where, held)
            elif prev_frozen is not None:
                errors += _check_stability(prev_frozen, s, where)
            held = _held_after(s, held if s.carried else {})
            prev_frozen = s
        prev = s
    # S3/S4: a node starts workers only for a frozen round that lists it, once per round.
    seen: set[tuple[int, str]] = set()
    for ev in accepted:
        n, node = int(ev["round"]), str(ev["node"])
        s = frozen.get(n)
        if s is None or node not in [p.node_id for p in s.participants]:
            errors.append(
                f"S3 round {n}: node {node} started workers outside a frozen round listing it"
            )
        elif s.participants[int(ev["node_rank"])].node_id != node:
            errors.append(f"S4 round {n}: node {node} used rank {ev['node_rank']} of another")
        if (n, node) in seen:
            errors.append(f"S4 round {n}: node {node} accepted the round twice")
        seen.add((n, node))
    return errors


def _backwards(prev: st.RoundState, s: st.RoundState) -> bool:
    """S5: rounds move forward only; within a round JOINING → FROZEN → CLOSED. A JOINING round
    may be rewritten as JOINING only to annotate it: to carry an earlier failure with its reason
    line (the root cause is the first failure, not the first report), or to publish the first
    round's last call. Nothing else of it may change.
    """
    if s.number != prev.number:
        return s.number < prev.number
    return s.phase <= prev.phase and s.phase != st.CLOSED and not _annotated(prev, s)


# Written into a gathering round for people (the last call's deadline): never decide anything.
_NOTES = ("last_call_deadline_unix_ms", "last_call_joined")


def _annotated(a: st.RoundState, b: st.RoundState) -> bool:
    if not a.phase == b.phase == st.JOINING:
        return False
    ka, kb = st.RoundState(), st.RoundState()
    ka.CopyFrom(a)
    kb.CopyFrom(b)
    cleared = list(_NOTES)
    if a.HasField("failure") and b.HasField("failure"):  # only a failure replaces a failure
        cleared += ["failure", "reason"]
    for name in cleared:
        ka.ClearField(name)
        kb.ClearField(name)
    return ka == kb


def _check_frozen(s: st.RoundState, where: str, min_nodes: int, max_nodes: int) -> list[str]:
    errors = []
    ps = list(s.participants)
    if [p.node_rank for p in ps] != list(range(len(ps))):
        errors.append(f"S2 {where}: node ranks {[p.node_rank for p in ps]} not 0..k-1")
    if not min_nodes <= len(ps) <= max_nodes:
        errors.append(f"S2 {where}: {len(ps)} nodes outside [{min_nodes}, {max_nodes}]")
    if len({p.node_id for p in ps}) != len(ps):
        errors.append(f"S2 {where}: a node listed twice")
    first = 0
    for p in ps:
        if p.first_global_rank != first:
            errors.append(
                f"S2 {where}: node rank {p.node_rank} starts at global rank "
                f"{p.first_global_rank}, expected {first}"
            )
        first += p.local_world_size
    if s.world_size != first:
        errors.append(f"S2 {where}: world_size {s.world_size} != {first}")
    if ps and s.master_addr != ps[0].addr:
        errors.append(f"S6 {where}: MASTER_ADDR {s.master_addr} is not rank 0's ({ps[0].addr})")
    return errors


def _check_stability(a: st.RoundState, b: st.RoundState, where: str) -> list[str]:
    """S6: survivors keep their relative order; rank 0 keeps rank 0 while it lives."""
    errors = []
    order_a = [p.node_id for p in a.participants]
    order_b = [p.node_id for p in b.participants]
    survivors = [n for n in order_a if n in order_b]
    if [n for n in order_b if n in survivors] != survivors:
        errors.append(f"S6 {where}: survivors reordered {survivors} -> {order_b}")
    if order_a and order_a[0] in order_b and order_b[0] != order_a[0]:
        errors.append(f"S6 {where}: rank 0 moved from {order_a[0]} to {order_b[0]}")
    return errors


def _check_carried(
    a: st.RoundState | None, b: st.RoundState, where: str, held: Mapping[str, set[int]]
) -> list[str]:
    """A carried round ``b``: it follows the frozen round before it; its members are that
    round's (less ``departed``) and ``arrived``; S6 as carried rounds keep it; S4's hand-over.
    """
    if a is None or a.phase != st.FROZEN or a.number != b.number - 1:
        return [f"S1 {where}: carried, but not from frozen round {b.number - 1}"]
    errors = []
    before = {p.node_id: p for p in a.participants}
    after = {p.node_id: p for p in b.participants}
    strangers = sorted(set(after) - set(before) - set(b.arrived))
    if strangers:
        errors.append(f"S3 {where}: carried {strangers}, neither members before nor arrivals")
    unnamed = sorted(set(before) - set(after) - set(b.departed))
    if unnamed or set(b.departed) & set(after):
        errors.append(f"S3 {where}: departures {list(b.departed)} do not match {unnamed}")
    order_a = [p.node_id for p in a.participants]
    if order_a and order_a[0] in after and after[order_a[0]].node_rank != 0:
        errors.append(f"S6 {where}: rank 0 moved from {order_a[0]}")
    for node in sorted(set(before) & set(after)):
        old, new = before[node].node_rank, after[node].node_rank
        freed = old >= len(after) and order_a[new] not in after
        if old != new and not freed:
            errors.append(f"S6 {where}: {node} moved from node rank {old} to {new}")
    spans = sorted(
        (f, f + after[n].local_world_size, n) for n, fs in held.items() if n in after for f in fs
    )
    for p in b.participants:
        lo, hi = p.first_global_rank, p.first_global_rank + p.local_world_size
        taken = [n for f, e, n in spans if f < hi and e > lo and n != p.node_id]
        if taken:
            errors.append(
                f"S4 {where}: {p.node_id} given global ranks [{lo}, {hi}) that {taken[0]} "
                "may still hold (it held them since the last gathered round and is listed)"
            )
    return errors


def _held_after(s: st.RoundState, held: Mapping[str, set[int]]) -> dict[str, set[int]]:
    """What each member of frozen round ``s`` may hold from here on: its ranks, and for a
    carried round what it held before (a gathered round: every member stopped its old workers
    before joining). Nodes not listed are gone: their workers were fenced (S4).
    """
    return {p.node_id: {p.first_global_rank, *held.get(p.node_id, ())} for p in s.participants}


def check_run(
    client: EtcdClient,
    keys: RunKeys,
    min_nodes: int,
    max_nodes: int,
    accepted: Iterable[Mapping] = (),
) -> list[str]:
    return check(round_history(client, keys), min_nodes, max_nodes, accepted)
