"""The election's line on a real etcd (rendezvous/etcd/leader/election.py): an agent finds its
predecessor from the tail key its registration read, with one read of one key; the full read of
the line (a Range sorted by create revision, which etcd serves by reading every agent key) is
left for when that predecessor is gone or the tail cannot be trusted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from rdzv_helpers import new_run_id

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.keys import RunKeys
from etcdrun.rendezvous.etcd.leader.election import Election
from etcdrun.rendezvous.etcd.node.session import Session


@pytest.fixture
def run(etcd) -> Iterator[tuple[EtcdClient, RunKeys, list]]:
    """A client that records every sorted Range it sends, the run's keys, and the sessions
    opened (closed at the end; the run must then hold no key at all).
    """
    keys = RunKeys("/etcdrun", new_run_id())
    sessions: list[Session] = []
    with EtcdClient(etcd.endpoints) as c:
        sorted_reads: list[str] = []
        plain = c.range

        def range_(key, *a, **kw):
            if kw.get("sort"):
                sorted_reads.append(key)
            return plain(key, *a, **kw)

        c.range = range_  # type: ignore[method-assign]
        c.sorted_reads = sorted_reads  # type: ignore[attr-defined]
        yield c, keys, sessions
        for s in sessions:
            s.close()
        assert plain(keys.root, prefix=True).kvs == []  # the tail went with its lease


def register(c: EtcdClient, keys: RunKeys, sessions: list, name: str) -> Session:
    info = st.AgentInfo(node_id=name, host="h", addr=f"{name}.addr", local_world_size=1)
    s = Session.open(c, keys, info, ttl=10)
    sessions.append(s)
    return s


def watched(election: Election, older: Session) -> bool:
    """Whether ``election`` wakes when ``older`` leaves (so it was watching that agent)."""
    woke = threading.Event()
    election._on_change = woke.set  # type: ignore[attr-defined]
    older.close()
    return woke.wait(10)


def test_an_agent_finds_its_predecessor_in_the_tail_and_reads_no_line(run):
    c, keys, sessions = run
    s = [register(c, keys, sessions, f"n{i}") for i in range(4)]
    assert s[0].registered_after is None
    for before, me in zip(s, s[1:], strict=False):
        assert me.registered_after == (before.node_id, before.create_revision)
    e = Election(s[3], keys.agents, lambda: None)
    assert e.check() is False
    assert c.sorted_reads == []
    assert watched(e, s[2])
    # Its predecessor gone, the tail names a dead agent: the line is read once, in full.
    assert e.check() is False
    assert c.sorted_reads == [keys.agents]
    assert watched(e, s[1])
    e.close()


def test_the_first_agent_leads(run):
    c, keys, sessions = run
    first = register(c, keys, sessions, "n0")
    e = Election(first, keys.agents, lambda: None)
    assert e.check() is True
    assert e.is_leader


def test_a_tail_naming_a_newer_incarnation_is_not_trusted(run):
    """The agent named by the tail left and its node id registered again, after this one: the
    key exists but is younger. Trusting it would make two agents watch each other.
    """
    c, keys, sessions = run
    s0, s1, s2 = (register(c, keys, sessions, f"n{i}") for i in range(3))
    s1.close()
    again = register(c, keys, sessions, "n1")
    assert again.create_revision > s2.create_revision
    e = Election(s2, keys.agents, lambda: None)
    assert e.check() is False
    assert c.sorted_reads == [keys.agents]
    assert watched(e, s0)
    e.close()


@pytest.mark.parametrize("garbage", [b"\xff\xfe", b"nobody", b""])
def test_a_foreign_tail_costs_a_read_of_the_line_and_no_wrong_leader(run, garbage):
    c, keys, sessions = run
    s0 = register(c, keys, sessions, "n0")
    c.put(keys.tail, garbage)  # an etcdctl put: the tail now names no agent
    s1 = register(c, keys, sessions, "n1")
    e = Election(s1, keys.agents, lambda: None)
    assert e.check() is False
    assert len(c.sorted_reads) == 1
    assert watched(e, s0)
    assert e.check() is True  # the oldest now
    e.close()
