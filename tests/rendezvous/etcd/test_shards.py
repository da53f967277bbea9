"""The shard layout and its values, without etcd (design.md §2, "Sharded rounds")."""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core import codec, shards, transitions
from etcdrun.rendezvous.etcd.core.config import SETTINGS, EtcdRendezvousConfig
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import SHARDED, Member, Phase, Round, Sharded

KEYS = RunKeys("/etcdrun", "job")


def frozen(n: int, number: int = 3, lws: int = 2, **kw) -> Round:
    members = tuple(
        Member(f"host-{i:05d}.1", i, lws, f"10.0.{i // 250}.{i % 250}", i * lws, f"host-{i}", 7)
        for i in range(n)
    )
    return Round(number, Phase.FROZEN, members, 2, members[0].addr, 29500, **kw)


def test_the_shard_count_is_fixed_so_a_node_knows_its_key_before_any_round():
    for n in (2, 5, 256, 1000, 8192):
        assert shards.shard(frozen(n), 2).sharded == Sharded(64, n, 2 * n)
    assert shards.SHARDS == 64


def test_a_node_s_shard_is_crc32_of_its_id_modulo_the_count():
    assert shards.index("host-a.1", 7) == zlib.crc32(b"host-a.1") % 7
    assert shards.index("host-a.1", 1) == 0


def test_below_shard_at_a_round_is_written_as_before():
    r = frozen(255)
    assert shards.shard(r, 256) is r
    joining = Round(3, Phase.JOINING, frozen(300).members)
    assert shards.shard(joining, 256) is joining  # a hint is never sharded
    value = st.RoundState.FromString(codec.round_to(r))
    assert (value.shards, value.node_count) == (0, 0) and value.participants_zlib  # packed, as ever


def test_from_shard_at_a_frozen_round_is_sharded_and_asks_protocol_4():
    r = shards.shard(frozen(256, carried=True, protocol=2), 256)
    assert r.sharded == Sharded(64, 256, 512) and r.protocol == SHARDED == 4 and r.whole
    assert (r.node_count, r.world_size) == (256, 512)


def test_split_puts_each_member_in_its_shard_in_rank_order_and_loses_nobody():
    r = shards.shard(frozen(1000), 256)
    parts = shards.split(r)
    assert len(parts) == 64
    for i, ms in enumerate(parts):
        assert all(shards.index(m.node_id, 64) == i for m in ms)
        assert [m.node_rank for m in ms] == sorted(m.node_rank for m in ms)
    got = dict(enumerate(parts))
    assert shards.problems(r.sharded, got) == []
    assert shards.joined(got) == r.members


def test_problems_name_a_missing_shard_a_node_astray_and_wrong_counts():
    r = shards.shard(frozen(20), 4)
    parts = dict(enumerate(shards.split(r)))
    layout = r.sharded
    assert layout is not None
    missing = {i: ms for i, ms in parts.items() if i != 1}
    assert any("shard(s) [1] of 64 missing" in p for p in shards.problems(layout, missing))
    astray = dict(parts)
    moved = parts[0][0]
    astray[0], astray[1] = parts[0][1:], (*parts[1], moved)
    assert any("hash elsewhere" in p for p in shards.problems(layout, astray))
    fewer = Sharded(layout.shards, layout.nodes + 1, layout.world_size)
    assert any("the round says 21" in p for p in shards.problems(fewer, parts))
    wider = Sharded(layout.shards, layout.nodes, layout.world_size + 1)
    assert any("world size" in p for p in shards.problems(wider, parts))


def test_the_header_lists_nobody_and_reads_back_as_the_layout():
    r = shards.shard(frozen(300, held=(("host-00001.1", (40,)),)), 256)
    value = codec.round_to(r)
    raw = st.RoundState.FromString(value)
    assert raw.schema_version == 1 and not raw.participants and not raw.participants_zlib
    assert (raw.shards, raw.node_count, raw.world_size, raw.protocol) == (64, 300, 600, 4)
    assert len(value) < 200  # what every watcher receives: a few fields, not 300 entries
    back = codec.round_from(KEYS.round, value, 9, "job")
    assert back.sharded == r.sharded and back.members == () and not back.whole
    assert (back.node_count, back.world_size, back.master_port) == (300, 600, 29500)


def test_a_shard_value_round_trips_with_ranks_and_what_its_nodes_held():
    r = shards.shard(frozen(300, held=(("host-00001.1", (40,)),)), 256)
    for i, ms in enumerate(shards.split(r)):
        back = codec.shard_from(KEYS.shard(i), codec.shard_to(r, ms), 3, "job")
        assert back.members == ms and back.number == 3
        assert codec.shard_from(KEYS.shard(i), codec.shard_to(r, ms), None, "job") == back
        assert back.held_by("host-00001.1") == ((40,) if r.member("host-00001.1") in ms else ())
    big = codec.shard_to(r, r.members[:64])  # from PACK_AT on, deflated as a round is
    assert st.RoundState.FromString(big).schema_version == codec.PACKED_SCHEMA_VERSION
    assert codec.shard_from("k", big, 3, "job").members == r.members[:64]


def test_a_shard_of_another_round_or_a_header_with_a_list_is_corrupt():
    r = shards.shard(frozen(10), 4)
    value = codec.shard_to(r, shards.split(r)[0])
    with pytest.raises(RendezvousStateError, match="not a shard of round 4"):
        codec.shard_from("k", value, 4, "job")
    bad = st.RoundState.FromString(codec.round_to(r))
    bad.participants.add(node_id="x")
    with pytest.raises(RendezvousStateError, match="in 64 shards"):
        codec.round_from("k", bad.SerializeToString(), 1, "job")


@pytest.mark.parametrize("n", [256, 4096, 8192])
def test_the_freeze_and_the_carry_stay_one_txn_under_etcd_s_128_ops(n):
    r = shards.shard(frozen(n), 256)
    current = Round(3, Phase.JOINING, mod_revision=5)
    _, ops = transitions.freeze(KEYS, current, r, None, "leader")
    assert len(ops) == 1 + shards.SHARDS <= 128
    assert {op.request_put.key.decode() for op in ops[1:]} == {
        KEYS.shard(i) for i in range(shards.SHARDS)
    }
    carried = Round(4, Phase.FROZEN, r.members, carried=True, sharded=r.sharded, protocol=4)
    _, ops = transitions.carry(KEYS, r, carried, codec.Why(), "leader")
    assert len(ops) == 2 + shards.SHARDS <= 128
    # older rounds' records go; the shard keys sort after every round and are rewritten
    dropped = ops[1].request_delete_range
    assert dropped.range_end == KEYS.round_dir(4).encode()
    assert all(not (dropped.key <= KEYS.shard(i).encode() < dropped.range_end) for i in range(64))


def test_closing_a_sharded_round_keeps_its_layout_and_lists_nobody():
    r = shards.shard(frozen(10), 4)
    closed, (_, ops) = transitions.close(KEYS, r, st.SUCCEEDED, None, 7, "n")
    msg = st.RoundState.FromString(ops[0].request_put.value)
    assert msg.phase == st.CLOSED and msg.shards == 64 and not msg.participants
    assert codec.round_from("k", ops[0].request_put.value, 1, "job").sharded == r.sharded


def test_shard_keys_parse_apart_from_barriers():
    assert KEYS.parse(KEYS.shard(12)) == ("shard", None, "12")
    assert KEYS.shard(12).startswith(KEYS.rounds)  # removed with the run's records
    assert KEYS.parse(KEYS.barrier(3, "exit") + "n") == ("barrier", 3, "n")


def test_a_round_counts_the_live_agents_it_leaves_waiting():
    whole = frozen(4)
    live = ["host-00000.1", "host-00003.1", "newcomer.1"]
    assert whole.outside(live) == 1  # only the newcomer is outside a whole round
    header = replace(shards.shard(frozen(4), 2), members=())
    assert not header.whole and header.outside(live + ["other.1", "more.1"]) == 1  # 5 - 4
    assert header.outside(live) == 0  # never below zero: members whose keys are gone
    assert Round(4, Phase.JOINING, whole.members).outside(live) == 3  # nobody is placed yet


def test_shard_at_0_the_default_never_shards():
    assert EtcdRendezvousConfig.__dataclass_fields__["shard_at"].default == 0
    r = frozen(300)
    assert shards.shard(r, 0) is r
    assert SETTINGS["shard_at"]("0") == 0 and SETTINGS["shard_at"]("2") == 2
    with pytest.raises(ValueError, match="0 \\(off\\) or at least 2"):
        SETTINGS["shard_at"]("1")
