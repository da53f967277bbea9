"""Sharded rounds: which shard key holds which participant of a large frozen round.

Why: every agent watches the round key, so a frozen round that lists all N participants makes
etcd send N copies of an O(N) value, O(N^2) bytes a round, where each node needs only its own
entry (bench/results/rendezvous_scale.md, 'What a node needs from a round'). From ``shard_at``
participants (rdzv_conf; 0, the default, is never: design.md §2 says why) the round key holds a
header (number, phase, master, world size, restart count, the shard count) and the participants go
to the run's ``SHARDS`` shard keys, a node's shard picked by a hash of its node id; each node
watches its own shard key, so etcd sends each node one shard of about N/SHARDS entries:
O(N^2/SHARDS) bytes a round. The count is fixed, not grown with N, so that a node knows its key
before any round and places its watch once per session (node/own_shard.py). It is
``SHARDS`` = 64 so that the freeze stays one Txn under etcd's default ``--max-txn-ops`` (128): the
round key, the shard puts, the delete of older rounds. Pure: the transitions, the checker and
``etcdrun status`` use it without I/O; reading shards from etcd is shard_reads.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from etcdrun.rendezvous.etcd.core.protocol import SHARDED, Member, Phase, Round, Sharded

SHARDS = 64


def index(node_id: str, shards: int) -> int:
    """The shard of ``node_id``: a hash every version computes alike (crc32, not Python's
    salted ``hash``), so that a node finds its entry without reading any other shard.
    """
    return zlib.crc32(node_id.encode()) % shards


def shard(r: Round, shard_at: int) -> Round:
    """``r`` as it is written: a FROZEN round of ``shard_at`` participants or more (0: none) is
    sharded, and says so to older agents with the protocol it needs (they stop with one line,
    run_gate).
    """
    if not shard_at or r.phase is not Phase.FROZEN or len(r.members) < shard_at:
        return r
    layout = Sharded(SHARDS, len(r.members), r.world_size)
    return replace(r, sharded=layout, protocol=max(r.protocol, SHARDED))


def split(r: Round) -> tuple[tuple[Member, ...], ...]:
    """The members of the whole, sharded ``r`` in each of its shards, in node-rank order."""
    assert r.sharded is not None and r.whole
    out: list[list[Member]] = [[] for _ in range(r.sharded.shards)]
    for m in r.members:
        out[index(m.node_id, r.sharded.shards)].append(m)
    return tuple(tuple(ms) for ms in out)


class Entry(Protocol):
    """A participant as the readers hold it: a Member, or the stored message (the checker)."""

    @property
    def node_id(self) -> str: ...

    @property
    def local_world_size(self) -> int: ...


def problems(layout: Sharded, got: Mapping[int, Sequence[Entry]]) -> list[str]:
    """What is wrong with shards read for a round of ``layout`` (empty: they make the round):
    every shard present, each member in the shard its node id hashes to, the header's counts.
    """
    out = []
    missing = sorted(set(range(layout.shards)) - set(got))
    if missing:
        out.append(f"shard(s) {missing} of {layout.shards} missing")
    extra = sorted(set(got) - set(range(layout.shards)))
    if extra:
        out.append(f"shard(s) {extra} beyond the {layout.shards} the round names")
    for i, ms in got.items():
        astray = [m.node_id for m in ms if index(m.node_id, layout.shards) != i]
        if astray:
            out.append(f"shard {i} holds {astray}, which hash elsewhere")
    members = [m for ms in got.values() for m in ms]
    if len(members) != layout.nodes:
        out.append(f"{len(members)} participants in the shards, the round says {layout.nodes}")
    if sum(m.local_world_size for m in members) != layout.world_size:
        out.append(f"the shards' world size is not the round's {layout.world_size}")
    return out


def joined(got: Mapping[int, Sequence[Member]]) -> tuple[Member, ...]:
    """Every member of a sharded round from its shards, in node-rank order."""
    return tuple(sorted((m for ms in got.values() for m in ms), key=lambda m: m.node_rank))


__all__ = ["SHARDS", "index", "joined", "problems", "shard", "split"]
