"""Large rounds travel deflated (schema 2): every reader sees the same members, small rounds stay
schema 1, and a value that lies about its packing is refused by name, never read as a round.
"""

from __future__ import annotations

import zlib

import pytest
from rdzv_helpers import accepted_events, handler, new_run_id, rendezvous, shutdown_all, violations

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.client import txn as t
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Member, Phase, Round
from etcdrun.rendezvous.etcd.node import lifecycle
from etcdrun.rendezvous.tools import status

KEY = "/etcdrun/r/round"


def frozen(n: int) -> Round:
    members = tuple(
        Member(
            f"gpu-{i:04d}-3f2a9.1",
            i,
            8,
            f"10.0.{i // 256}.{i % 256}",
            8 * i,
            f"gpu-{i:04d}",
            4000 + i,
        )
        for i in range(n)
    )
    return Round(4, Phase.FROZEN, members, 2, "10.0.0.0", 29500)


def wire(value: bytes) -> st.RoundState:
    """The value as etcd holds it, not as the codec hands it out."""
    return st.RoundState.FromString(value)


@pytest.mark.parametrize("n", [1, codec.PACK_AT - 1, codec.PACK_AT, 4096])
def test_a_round_reads_back_the_same_whatever_its_size(n):
    r = frozen(n)
    why = codec.Why("agent joined", departed=("a",), departed_cause=("left",))
    value = codec.round_to(r, why=why)
    got, msg = codec.round_and_message(KEY, value, 9, "r")
    assert got.members == r.members and got.world_size == 8 * n
    assert (got.number, got.restart_count, got.master_port) == (4, 2, 29500)
    assert msg.reason == "agent joined" and list(msg.departed_cause) == ["left"]
    assert len(msg.participants) == n and not msg.participants_zlib
    raw = wire(value)
    if n < codec.PACK_AT:  # any agent version reads it
        assert raw.schema_version == 1 and len(raw.participants) == n
    else:
        assert raw.schema_version == 2 and len(raw.participants) == 0
        assert len(raw.participants_zlib) > 0


def test_a_4096_node_round_is_at_most_a_third_of_its_plain_size():
    r = frozen(4096)
    packed = codec.round_to(r)
    plain = wire(packed)
    plain.ClearField("participants_zlib")
    plain.participants.extend(codec.round_message(packed, KEY).participants)
    assert len(packed) * 3 <= len(plain.SerializeToString())


def test_a_packed_rounds_message_is_written_back_packed():
    """The repair and a writer's own view re-encode a decoded message: it stays schema 2."""
    msg = codec.round_message(codec.round_to(frozen(codec.PACK_AT)), KEY)
    again = wire(codec.encode_round(msg))
    assert again.schema_version == 2 and not again.participants
    small = codec.round_message(codec.round_to(frozen(3)), KEY)
    assert wire(codec.encode_round(small)).schema_version == 1


def test_the_writers_own_view_of_a_packed_round_has_its_members():
    keys = RunKeys("/etcdrun", "r")
    ops = [t.put(keys.round, codec.round_to(frozen(codec.PACK_AT)))]
    assert len(lifecycle.written(ops).participants) == codec.PACK_AT


def lies() -> dict[str, bytes]:
    good = wire(codec.round_to(frozen(codec.PACK_AT)))
    out = {}
    m = st.RoundState()
    m.CopyFrom(good)
    m.schema_version = 1  # says plain, carries deflated
    out["schema 1 with a deflated list"] = m.SerializeToString()
    m = st.RoundState()
    m.CopyFrom(good)
    m.ClearField("participants_zlib")
    out["schema 2 without one"] = m.SerializeToString()
    m = st.RoundState()
    m.CopyFrom(good)
    m.participants.add(node_id="x")
    out["schema 2 with plain participants too"] = m.SerializeToString()
    m = st.RoundState()
    m.CopyFrom(good)
    m.participants_zlib = good.participants_zlib[:-5]
    out["a truncated list"] = m.SerializeToString()
    m = st.RoundState()
    m.CopyFrom(good)
    m.participants_zlib = b"not deflate at all"
    out["not deflate"] = m.SerializeToString()
    m = st.RoundState()
    m.CopyFrom(good)
    m.participants_zlib = zlib.compress(b"\xff" * 100)
    out["deflated garbage"] = m.SerializeToString()
    return out


@pytest.mark.parametrize("what", list(lies()))
def test_a_value_that_lies_about_its_packing_is_refused_by_name(what):
    with pytest.raises(RendezvousStateError) as e:
        codec.round_from(KEY, lies()[what], 9, "r")
    assert KEY in str(e.value) and "corrupt value" in str(e.value)


def test_a_list_that_inflates_beyond_the_bound_is_refused(monkeypatch):
    value = codec.round_to(frozen(codec.PACK_AT))
    monkeypatch.setattr(codec, "MAX_INFLATED", 1000)
    with pytest.raises(RendezvousStateError, match="at most 1000 bytes"):
        codec.round_message(value, KEY)


def test_a_newer_schema_is_still_refused():
    m = wire(codec.round_to(frozen(codec.PACK_AT)))
    m.schema_version = 3
    with pytest.raises(RendezvousStateError, match="unknown schema version 3"):
        codec.round_message(m.SerializeToString(), KEY)
    with pytest.raises(RendezvousStateError, match="unknown schema version 2"):
        codec.decode(
            st.AgentInfo, "/etcdrun/r/agents/a", st.AgentInfo(schema_version=2).SerializeToString()
        )


def test_real_rounds_packed_from_two_nodes_on(etcd, monkeypatch):
    """The whole path on a real etcd with every round packed: the join, a carried leave (its
    held ranks packed too), a restart (its hint packed), status, and the invariant checker
    replaying etcd's history.
    """
    monkeypatch.setattr(codec, "PACK_AT", 2)
    run = new_run_id()
    keys = RunKeys("/etcdrun", run)
    hs = [handler(etcd.endpoints, run, 2, 4) for _ in range(4)]
    with accepted_events(hs) as acc:
        try:
            infos = rendezvous(hs)
            assert sorted(i.node_rank for i in infos) == [0, 1, 2, 3]
            with EtcdClient(etcd.endpoints) as c:
                raw = wire(c.get(keys.round).value)
                assert raw.schema_version == 2 and not raw.participants
                s = status.read(c, keys)
                assert (len(s.participants), s.world_size, s.unreadable) == (4, 4, ())
            by_rank = {i.node_rank: h for i, h in zip(infos, hs, strict=True)}
            by_rank[1].shutdown()
            rest = [by_rank[0], by_rank[2], by_rank[3]]
            for h in rest:
                assert h.membership_changed.wait(5)
            infos2 = rendezvous(rest)  # carried (design.md §3a): the last fills the place
            assert [i.node_rank for i in infos2] == [0, 2, 1]
            assert {len(i.participants) for i in infos2} == {3}
            with EtcdClient(etcd.endpoints) as c:
                raw = wire(c.get(keys.round).value)
                assert raw.schema_version == 2 and raw.carried and not raw.participants
                moved = codec.round_from(keys.round, c.get(keys.round).value, 1, run)
                assert moved.held_by(by_rank[3].node_id) == (3,)  # its old rank, packed too
            assert rest[0].request_restart("a worker failed")  # a restart gathers, with a hint
            infos3 = rendezvous(rest)
            assert {i.round for i in infos3} == {3}
            with EtcdClient(etcd.endpoints) as c:
                hint = c.get(keys.hint(3)).value
                assert wire(hint).schema_version == 2
                hint_ids = [m.node_id for m in codec.hint_from(keys.hint(3), hint, run)]
                by_rank2 = sorted(infos2, key=lambda i: i.node_rank)
                assert hint_ids == [i.node_id for i in by_rank2]  # round 2's, in order
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 4, acc) == []
