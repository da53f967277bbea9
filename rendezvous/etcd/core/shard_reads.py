"""Reading a sharded round's participants from etcd: a node's own shard, or all of them.

Why apart from shards.py: that module is the pure layout, used by the transitions and the
checker; this one does the reads. Both read at the round key's mod_revision (one Range), so
what they see is what the header was written with, even after later rounds rewrote the shard
keys. When that revision was compacted, the keys as they are now serve if they still hold that
round (their value names it); a shard of another round means the round moved on. A node learns
its own shard by a watch (node/own_shard.py); it reads here only when that watch cannot say.
"""

from __future__ import annotations

from dataclasses import replace

from etcdrun.rendezvous.client import EtcdClient, EtcdCompactedError, EtcdRequestError
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core import codec, shards
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Member, Round


def own(client: EtcdClient, keys: RunKeys, r: Round, node_id: str) -> Round | None:
    """``r`` with the members of ``node_id``'s shard (the node is among them when it takes
    part); ``r`` itself when it is whole. None when the shard is gone: the round moved on.
    """
    if r.whole:
        return r
    assert r.sharded is not None
    i = shards.index(node_id, r.sharded.shards)
    got = _read(client, keys, r, keys.shard(i), prefix=False)
    if i not in got:
        return None
    return replace(r, members=got[i].members, held=got[i].held)


def whole(client: EtcdClient, keys: RunKeys, r: Round) -> Round | None:
    """``r`` with every member (``r`` itself when it is whole already); None when its shards
    are gone. Shards that do not make the round the header says are corrupt state.
    """
    if r.whole:
        return r
    assert r.sharded is not None
    got = _read(client, keys, r, keys.shards, prefix=True)
    if not got:
        return None
    by_shard: dict[int, tuple[Member, ...]] = {i: s.members for i, s in got.items()}
    wrong = shards.problems(r.sharded, by_shard)
    if wrong:
        raise RendezvousStateError(
            f"round {r.number}'s shards under {keys.shards}: {'; '.join(wrong)}",
            run_id=keys.run_id,
            round=r.number,
        )
    held = tuple(h for s in got.values() for h in s.held)
    return replace(r, members=shards.joined(by_shard), held=held)


def _at(client: EtcdClient, key: str, prefix: bool, revision: int) -> list:
    """The keys at ``revision``, read serializably: a past revision never changes, so the
    member that answers needs no quorum round (ReadIndex) for it, which N nodes reading at once
    would otherwise cost etcd's leader. A member that has not applied that revision yet says
    "future revision"; a linearizable read then waits for it.
    """
    try:
        return list(client.range(key, prefix=prefix, revision=revision, serializable=True).kvs)
    except EtcdRequestError:
        return list(client.range(key, prefix=prefix, revision=revision).kvs)


def _read(
    client: EtcdClient, keys: RunKeys, r: Round, key: str, *, prefix: bool
) -> dict[int, Round]:
    """The shards of round ``r`` under ``key`` (one, or the prefix), by index."""
    try:
        kvs = _at(client, key, prefix, r.mod_revision)
    except EtcdCompactedError:
        kvs = client.range(key, prefix=prefix).kvs
    out: dict[int, Round] = {}
    for kv in kvs:
        kind, _, i = keys.parse(kv.key)
        if kind != "shard" or i is None or not i.isdigit():
            continue
        got = codec.shard_from(kv.key, kv.value, None, keys.run_id)
        if got.number == r.number:  # another round's: this one moved on (compacted reads)
            out[int(i)] = got
    return out


__all__ = ["own", "whole"]
