"""OwnShard on a real etcd (rendezvous/etcd/node/own_shard.py): a node's shard of a sharded
round comes by the watch of its shard key, in either order with the header; a round frozen
before the node registered does not hold it; a watch that ended, or none, falls back to one read;
a cancelled placement's late batch is dropped.
"""

from __future__ import annotations

import time

import pytest
from rdzv_helpers import new_run_id, shard_reads_recorded

from etcdrun.rendezvous.client import EtcdClient, EtcdError, WatchBatch
from etcdrun.rendezvous.etcd.core import codec, shard_reads, shards, transitions
from etcdrun.rendezvous.etcd.core.config import EtcdRendezvousConfig
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Member, Phase, Round, Settings
from etcdrun.rendezvous.etcd.core.round_view import RoundView
from etcdrun.rendezvous.etcd.node.own_shard import OwnShard
from etcdrun.rendezvous.events import EventLog

ME = "me-1.1"


def context(client: EtcdClient, run: str) -> RunContext:
    keys = RunKeys("/etcdrun", run)
    return RunContext(
        client, keys, EventLog(run), RoundView(), Settings(1, 64), EtcdRendezvousConfig(shard_at=2)
    )


def freeze(ctx: RunContext, number: int, names: list[str]) -> Round:
    """Write a sharded frozen round as the leader does (one Txn); the header as read back."""
    members = tuple(Member(n, i, 1, f"{n}.host", i) for i, n in enumerate(names))
    new = shards.shard(Round(number, Phase.FROZEN, members, master_addr="a", master_port=1), 1)
    cur = ctx.client.get(ctx.keys.round)
    current = Round(number, Phase.JOINING, mod_revision=cur.mod_revision if cur else 0)
    guard, ops = transitions.freeze(ctx.keys, current, new, None, "test")
    res = ctx.client.txn(guard, ops)
    assert res.succeeded
    kv = ctx.client.get(ctx.keys.round)
    return codec.round_from(kv.key, kv.value, kv.mod_revision, ctx.keys.run_id)


def settle(ctx: RunContext, seat: OwnShard, header: Round) -> None:
    """Wait, as the handler does, on the round view until the shard is no longer due."""
    ok = ctx.view.wait(None, time.monotonic() + 10, stop=lambda: not seat.pending(header, ME))
    assert ok, "the shard's watch event never came"


@pytest.fixture
def setup(etcd):
    with EtcdClient(etcd.endpoints) as c:
        ctx = context(c, new_run_id())
        seat = OwnShard(ctx)
        try:
            yield ctx, seat
        finally:
            seat.cancel()


def test_the_shard_comes_by_watch_whatever_the_order_and_needs_no_read(setup, monkeypatch):
    ctx, seat = setup
    monkeypatch.setattr(shard_reads, "own", lambda *a: pytest.fail("read, not watched"))
    registered = ctx.client.put(ctx.keys.agent(ME), b"x")
    seat.place(ME, registered)
    header = freeze(ctx, 1, ["other-0.1", ME, "other-2.1"])
    assert header.sharded is not None and header.members == ()
    # at once after the write the event may not have come yet: then it is due, not "absent"
    first = seat.of(header, ME)
    assert (first is None) == seat.pending(header, ME)
    settle(ctx, seat, header)
    got = seat.of(header, ME)
    assert got is not None and got.mod_revision == header.mod_revision
    assert got.member(ME) is not None and got.member(ME).node_rank == 1
    assert {m.node_id for m in got.members} <= {"other-0.1", ME, "other-2.1"}
    # the next round rewrites the key: the older header now reads as moved on, never as the
    # newer round's shard
    later = freeze(ctx, 2, [ME, "other-0.1"])
    settle(ctx, seat, later)
    assert seat.of(header, ME) is None and not seat.pending(header, ME)
    assert seat.of(later, ME).member(ME).node_rank == 0


def test_a_round_frozen_before_the_node_registered_does_not_hold_it(setup, monkeypatch):
    ctx, seat = setup
    monkeypatch.setattr(shard_reads, "own", lambda *a: pytest.fail("read, not watched"))
    header = freeze(ctx, 1, ["other-0.1", "other-1.1"])
    registered = ctx.client.put(ctx.keys.agent(ME), b"x")
    seat.place(ME, registered)
    got = seat.of(header, ME)
    assert got is header and got.member(ME) is None and not seat.pending(header, ME)


def test_an_ended_watch_and_an_unplaced_one_read_the_shard_once_a_round(setup, monkeypatch):
    ctx, seat = setup
    calls = shard_reads_recorded(monkeypatch)
    header = freeze(ctx, 1, ["other-0.1", ME])
    # never placed (shard_at unset on this node): one read, however often the loop asks
    assert seat.of(header, ME).member(ME) is not None
    assert seat.of(header, ME).member(ME) is not None and calls == [1]
    # placed from a compacted revision: the watch ends, the node reads instead
    ctx.client.put(ctx.keys.agent(ME), b"x")
    ctx.client.compact(ctx.client.get(ctx.keys.round).mod_revision + 1)
    seat.place(ME, 1)
    ctx.view.wait(None, time.monotonic() + 10, stop=lambda: not seat.pending(header, ME))
    again = freeze(ctx, 2, [ME])
    assert not seat.pending(again, ME)  # ended: nothing is due by watch
    assert seat.of(again, ME).member(ME) is not None and calls == [1, 2]


def test_a_late_batch_of_a_cancelled_placement_is_dropped(setup, monkeypatch):
    """A batch that etcd sent to the watch of an earlier session, delivered after this node
    placed its watch again, changes nothing: neither an old shard nor an error that would end
    the new watch (the node would then read its shard).
    """
    ctx, seat = setup
    monkeypatch.setattr(shard_reads, "own", lambda *a: pytest.fail("read, not watched"))
    placed: list[tuple] = []  # per placement: the callback OwnShard gave, the batches it got
    real = ctx.client.watch

    def recording(key, **kw):
        deliver, got = kw["callback"], []
        placed.append((deliver, got))

        def callback(batch):
            got.append(batch)
            deliver(batch)

        return real(key, **{**kw, "callback": callback})

    monkeypatch.setattr(ctx.client, "watch", recording)
    seat.place(ME, ctx.client.put(ctx.keys.agent(ME), b"x"))
    settle(ctx, seat, freeze(ctx, 1, [ME]))
    seat.cancel()
    seat.place(ME, ctx.client.put(ctx.keys.agent(ME), b"y"))
    second = freeze(ctx, 2, [ME, "other-1.1"])
    settle(ctx, seat, second)
    deliver_late, first_batches = placed[0]
    late = [b for b in first_batches if b.events]
    assert late, "the first placement's watch brought no shard"
    for batch in late:
        deliver_late(batch)  # round 1's shard, older than round 2's
    deliver_late(WatchBatch(late[0].watch, [], 0, EtcdError("late end")))
    got = seat.of(second, ME)
    assert got is not None and not seat.pending(second, ME)
    assert got.number == 2 and got.member(ME).node_rank == 0
