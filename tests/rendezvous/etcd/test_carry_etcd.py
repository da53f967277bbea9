"""Carried rounds on a real etcd (design.md §3a): the survivors write nothing, only a newcomer
registers; rank 0 draws its next spare port; an agent refuses a round of a newer protocol.
"""

from __future__ import annotations

import subprocess

from agent_helpers import clean_env, etcdrun_bin
from rdzv_helpers import accepted_events, handler, new_run_id, rendezvous, shutdown_all, violations

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core import codec
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import PROTOCOL, Member, Phase, Round


def round_state(c: EtcdClient, keys: RunKeys) -> st.RoundState:
    return codec.round_message(c.get(keys.round).value, keys.round)


def spare(c: EtcdClient, keys: RunKeys, node: str) -> int:
    return codec.decode(st.AgentInfo, keys.agent(node), c.get(keys.agent(node)).value).spare_port


def test_a_leave_is_carried_and_the_survivors_write_nothing(etcd):
    run = new_run_id()
    keys = RunKeys("/etcdrun", run)
    hs = [handler(etcd.endpoints, run, 2, 4, lws=2) for _ in range(4)]
    with accepted_events(hs) as acc, EtcdClient(etcd.endpoints) as c:
        try:
            infos = rendezvous(hs)
            by_rank = {i.node_rank: h for i, h in zip(infos, hs, strict=True)}
            rest = [by_rank[0], by_rank[2], by_rank[3]]
            rank0, leaving = by_rank[0].node_id, by_rank[1].node_id
            before = c.get(keys.round).mod_revision
            by_rank[1].shutdown()
            for h in rest:
                assert h.membership_changed.wait(10)
            msg = round_state(c, keys)
            assert (msg.number, msg.phase, msg.carried) == (2, st.FROZEN, True)
            assert list(msg.departed) == [leaving] and msg.reason == f"node(s) left: {leaving}"
            assert msg.master_port == spare(c, keys, rank0)  # rank 0's spare, not yet redrawn
            # between the leave and the carried round, the survivors wrote nothing
            kvs = c.get_prefix(keys.root).kvs
            written = {kv.key.decode()[len(keys.root) :] for kv in kvs if kv.mod_revision > before}
            assert written == {"round"}, written
            infos2 = rendezvous(rest)
            assert [(i.round, i.node_rank) for i in infos2] == [(2, 0), (2, 2), (2, 1)]
            assert {i.master_port for i in infos2} == {msg.master_port} != {infos[0].master_port}
            # rank 0 ran round 2 on its spare: it drew another before it accepted
            assert spare(c, keys, rank0) not in (0, msg.master_port)
            assert not c.get_prefix(keys.joined(2)).kvs
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 2, 4, acc) == []


def test_a_newcomer_is_carried_in_with_its_registration_alone(etcd):
    run = new_run_id()
    keys = RunKeys("/etcdrun", run)
    hs = [handler(etcd.endpoints, run, 1, 3, last_call_timeout=0) for _ in range(2)]
    with accepted_events(hs) as acc, EtcdClient(etcd.endpoints) as c:
        try:
            first = rendezvous(hs)
            late = handler(etcd.endpoints, run, 1, 3)
            hs.append(late)
            infos = rendezvous(hs)
            assert {i.round for i in infos} == {2}  # the survivors keep their ranks, it comes last
            assert [i.node_rank for i in infos] == [*(i.node_rank for i in first), 2]
            msg = round_state(c, keys)
            assert msg.carried and list(msg.arrived) == [late.node_id] and not msg.departed
            assert not c.get_prefix(keys.joined(2)).kvs  # nobody joined: carried
        finally:
            shutdown_all(hs)
    assert violations(etcd.endpoints, run, 1, 3, acc) == []


def newer_round(endpoints: str, run: str) -> None:
    """Round 5 as an etcdrun of a protocol to come would write it."""
    keys = RunKeys("/etcdrun", run)
    r = Round(5, Phase.FROZEN, (Member("x", 0, 1, "x", 0),), master_addr="x", protocol=99)
    with EtcdClient(endpoints) as c:
        c.put(keys.round, codec.round_to(r))


def test_an_agent_refuses_a_round_of_a_newer_protocol_in_one_line(etcd):
    run = new_run_id()
    newer_round(etcd.endpoints, run)
    h = handler(etcd.endpoints, run, 1, 2)
    try:
        try:
            h.next_rendezvous()
            raise AssertionError("a round of protocol 99 was followed")
        except RendezvousStateError as e:
            said = str(e)
        assert "round 5 needs rendezvous protocol 99" in said
        assert f"follows protocol {PROTOCOL}" in said
        assert f"run {run}" in said and "round 5" in said and f"node {h.node_id}" in said
    finally:
        h.shutdown()


def test_the_cli_refusing_a_newer_protocol_exits_non_zero_with_one_line(etcd):
    run = new_run_id()
    newer_round(etcd.endpoints, run)
    argv = [etcdrun_bin(), "--nnodes", "1:2", "--rdzv-backend", "etcd"]
    argv += ["--rdzv-endpoint", etcd.endpoints, "--rdzv-id", run, "-m", "this"]
    proc = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "needs rendezvous protocol 99" in x]
    assert len(lines) == 1 and f"run {run}" in lines[0] and "round 5" in lines[0], proc.stderr
