"""The transactions that move the round key: open a round, freeze it, close the run.

Why one module: whoever writes (the leader deciding, an agent restarting after a worker failure,
the node that closes the run), each transition is the same single Txn, fenced on the round key's
mod_revision (S1) — or on its absence for the first round — so the rules live in one place.
Each function returns ``(compare, success)`` for ``EtcdClient.txn``.
"""

from __future__ import annotations

from etcdrun.proto import etcd_api_pb2 as pb
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.api import FailureInfo
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.etcd.core import codec, shards
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Member, Phase, Round

Txn = tuple[list[pb.Compare], list[pb.RequestOp]]


def fence(keys: RunKeys, current: Round | None) -> pb.Compare:
    """The round key is still exactly what the writer decided from."""
    if current is None:
        return t.create_revision(keys.round, "==", 0)
    return t.mod_revision(keys.round, "==", current.mod_revision)


def opening(
    number: int, restart_count: int, failure: FailureInfo | None = None, run_lease: int = 0
) -> Round:
    """Round ``number`` as it opens for joining: no members yet (the hint holds the previous
    ones); ``failure``: the worker failure that opened it, charged at the freeze.
    """
    return Round(number, Phase.JOINING, (), restart_count, failure=failure, run_lease=run_lease)


def start_round(
    keys: RunKeys,
    current: Round | None,
    new: Round,
    hint: tuple[Member, ...],
    why: codec.Why,
    by: str,
) -> Txn:
    """Open ``new`` (``opening()``) for joining; drop every older round's records in the same
    Txn. The hint (the previous participants, for rank stability) goes to its own key, read by
    the leader alone: the round key every agent watches stays a few bytes until the freeze.
    Both live under the new round's run lease (0: none), so that they cannot outlive every
    agent forever.
    """
    ops = [
        t.put(keys.round, codec.round_to(new, why=why, decided_by=by), new.run_lease),
        t.delete(keys.rounds, end=keys.round_dir(new.number)),
        t.put(keys.hint(new.number), codec.hint_to(new.number, hint), new.run_lease),
    ]
    return [fence(keys, current)], ops


def freeze(keys: RunKeys, current: Round, new: Round, why: st.RoundState | None, by: str) -> Txn:
    """Freeze ``current`` as ``new`` (FROZEN, its members and master; sharded when
    ``shards.shard`` made it so); ``why`` (departures.py) says why it opened, and the failure it
    carries, if any.
    """
    w = why or st.RoundState()
    failure = w.failure if w.HasField("failure") else None
    value = codec.round_to(new, why=codec.Why.of(w), decided_by=by, failure=failure)
    return [fence(keys, current)], [t.put(keys.round, value, new.run_lease), *_shards(keys, new)]


def _shards(keys: RunKeys, new: Round) -> list[pb.RequestOp]:
    """The shard puts of a sharded ``new`` (none otherwise), in the Txn that freezes it: the
    round key and its participants appear at one revision, or neither does (S1). Under the run
    lease, as the hints: they cannot outlive every agent.
    """
    if new.sharded is None:
        return []
    return [
        t.put(keys.shard(i), codec.shard_to(new, members), new.run_lease)
        for i, members in enumerate(shards.split(new))
    ]


def carry(keys: RunKeys, current: Round, new: Round, why: codec.Why, by: str) -> Txn:
    """Freeze ``new`` (FROZEN, carried: design.md §3a) straight from the FROZEN ``current``,
    fenced on it (S1), with why it opened; drop every older round's records in the same Txn,
    as opening a round does. No hint: the leader places the members from ``current`` itself.
    """
    ops = [
        t.put(keys.round, codec.round_to(new, why=why, decided_by=by), new.run_lease),
        t.delete(keys.rounds, end=keys.round_dir(new.number)),
        *_shards(keys, new),
    ]
    return [fence(keys, current)], ops


def close(
    keys: RunKeys,
    current: Round | None,
    outcome: int,
    failure: st.Failure | None,
    lease_id: int,
    by: str,
) -> tuple[Round, Txn]:
    """CLOSED under a lease: the marker outlives the agents, then expires by itself. It keeps
    naming the run lease (the hints still live under it), for the last agent out to revoke,
    and a sharded round's shard count (its shards stay until then: ``etcdrun status``).
    """
    new = Round(
        current.number if current else 1,
        Phase.CLOSED,
        current.members if current and current.sharded is None else (),
        current.restart_count if current else 0,
        run_lease=current.run_lease if current else 0,
        sharded=current.sharded if current else None,
    )
    value = codec.round_to(new, decided_by=by, outcome=outcome, failure=failure)
    return new, ([fence(keys, current)], [t.put(keys.round, value, lease_id)])


def clean_up_if_none_left(keys: RunKeys, current: Round | None) -> Txn:
    """Remove the run's keys when no agent key is left. Run by every agent right after it
    revoked its own lease, so that of agents leaving together, whichever goes last succeeds
    (a compare over an empty range matches a zero create revision). A CLOSED marker stays: it
    expires with its lease. After it succeeds, the caller revokes the run lease.
    """
    guard = [t.create_revision(keys.agents, "==", 0, prefix=True)]
    ops = [t.delete(keys.rounds, prefix=True)]
    if current is None or current.phase is not Phase.CLOSED:
        guard.append(fence(keys, current))
        ops.append(t.delete(keys.round))
    return guard, ops
