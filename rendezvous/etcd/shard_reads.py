"""Reading a sharded round's participants from etcd: a node's own shard, or all of them.

Why apart from shards.py: that module is the pure layout, used by the transitions and the
checker; this one does the reads. Both read at the round key's mod_revision (one Range), so
what they see is what the header was written with, even after the round moved on and opening
the next one removed the shards. When that revision was compacted, the keys as they are now
serve: a shard key is written once, by the Txn that froze its round, so a shard still there is
that round's; one gone means the round moved on.
"""

from __future__ import annotations

from dataclasses import replace

from etcdrun.rendezvous.client import EtcdClient, EtcdCompactedError, EtcdRequestError
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd import codec, shards
from etcdrun.rendezvous.etcd.keys import RunKeys
from etcdrun.rendezvous.etcd.protocol import Member, Phase, Round


def own(client: EtcdClient, keys: RunKeys, r: Round, node_id: str) -> Round | None:
    """``r`` with the members of ``node_id``'s shard (the node is among them when it takes
    part); ``r`` itself when it is whole. None when the shard is gone: the round moved on.
    """
    if r.whole:
        return r
    assert r.sharded is not None
    i = shards.index(node_id, r.sharded.shards)
    got = _read(client, keys, r, keys.shard(r.number, i), prefix=False)
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
    got = _read(client, keys, r, keys.shards(r.number), prefix=True)
    if not got:
        return None
    by_shard: dict[int, tuple[Member, ...]] = {i: s.members for i, s in got.items()}
    wrong = shards.problems(r.sharded, by_shard)
    if wrong:
        raise RendezvousStateError(
            f"round {r.number}'s shards under {keys.shards(r.number)}: {'; '.join(wrong)}",
            run_id=keys.run_id,
            round=r.number,
        )
    held = tuple(h for s in got.values() for h in s.held)
    return replace(r, members=shards.joined(by_shard), held=held)


class OwnShard:
    """One node's view of sharded rounds: ``own`` read once per round revision, whatever wakes
    the node's join loop (a round view wakes it for every event, and a header does not change
    without a new revision). Holds no session: the node id is passed on each call.
    """

    def __init__(self, client: EtcdClient, keys: RunKeys) -> None:
        self._client, self._keys = client, keys
        self._last: tuple[str, int, Round | None] | None = None

    def of(self, r: Round | None, node_id: str) -> Round | None:
        """``r`` as ``node_id`` needs it: a sharded frozen round with that node's shard; any
        other round as it is. None when the shard is gone: the round moved on, and the watch
        brings the newer one.
        """
        if r is None or r.phase is not Phase.FROZEN or r.whole:  # a CLOSED one's too: unread
            return r
        if self._last is None or self._last[:2] != (node_id, r.mod_revision):
            self._last = (node_id, r.mod_revision, own(self._client, self._keys, r, node_id))
        return self._last[2]


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
        kind, n, i = keys.parse(kv.key)
        if kind != "shard" or n != r.number or i is None or not i.isdigit():
            continue
        out[int(i)] = codec.shard_from(kv.key, kv.value, r.number, keys.run_id)
    return out


__all__ = ["OwnShard", "own", "whole"]
