"""The election's line on a real etcd (rendezvous/etcd/leader/election.py): an agent finds its
predecessor from the tail key its registration read, with one read of one key; the full read of
the line (a Range sorted by create revision, which etcd serves by reading every agent key) is
left for when that predecessor is gone or the tail cannot be trusted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from rdzv_helpers import new_run_id

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.session import Session
from etcdrun.rendezvous.etcd.leader.election import Election


@dataclass
class Run:
    """A client, the run's keys, the sessions opened and the prefixes of every sorted Range
    the client sent.
    """

    client: EtcdClient
    keys: RunKeys
    sessions: list[Session] = field(default_factory=list)
    sorted_reads: list[str] = field(default_factory=list)

    def register(self, name: str) -> Session:
        info = st.AgentInfo(node_id=name, host="h", addr=f"{name}.addr", local_world_size=1)
        s = Session.open(self.client, self.keys, info, ttl=10)
        self.sessions.append(s)
        return s

    def elect(self, session: Session) -> tuple[Election, threading.Event]:
        """The session's election, and the event its ``on_change`` sets."""
        woke = threading.Event()
        return Election(session, self.keys.agents, woke.set), woke


def watched(woke: threading.Event, older: Session) -> bool:
    """Whether the election whose ``on_change`` sets ``woke`` wakes when ``older`` leaves."""
    woke.clear()
    older.close()
    return woke.wait(10)


@pytest.fixture
def run(etcd, monkeypatch) -> Iterator[Run]:
    """Sessions are closed at the end; the run must then hold no key at all."""
    with EtcdClient(etcd.endpoints) as c:
        r = Run(c, RunKeys("/etcdrun", new_run_id()))
        plain = c.range

        def recording(key, *a, **kw):
            if kw.get("sort"):
                r.sorted_reads.append(key)
            return plain(key, *a, **kw)

        monkeypatch.setattr(c, "range", recording)
        yield r
        for s in r.sessions:
            s.close()
        assert plain(r.keys.root, prefix=True).kvs == []  # the tail went with its lease


def test_an_agent_finds_its_predecessor_in_the_tail_and_reads_no_line(run):
    s = [run.register(f"n{i}") for i in range(4)]
    assert s[0].registered_after is None
    for before, me in zip(s, s[1:], strict=False):
        assert me.registered_after == (before.node_id, before.create_revision)
    e, woke = run.elect(s[3])
    assert e.check() is False
    assert run.sorted_reads == []
    assert watched(woke, s[2])
    # Its predecessor gone, the tail names a dead agent: the line is read once, in full.
    assert e.check() is False
    assert run.sorted_reads == [run.keys.agents]
    assert watched(woke, s[1])
    e.close()


def test_the_first_agent_leads(run):
    e, _ = run.elect(run.register("n0"))
    assert e.check() is True
    assert e.is_leader


def test_a_tail_naming_a_newer_incarnation_is_not_trusted(run):
    """The agent named by the tail left and its node id registered again, after this one: the
    key exists but is younger. Trusting it would make two agents watch each other.
    """
    s0, s1, s2 = (run.register(f"n{i}") for i in range(3))
    s1.close()
    again = run.register("n1")
    assert again.create_revision > s2.create_revision
    e, woke = run.elect(s2)
    assert e.check() is False
    assert run.sorted_reads == [run.keys.agents]
    assert watched(woke, s0)
    e.close()


@pytest.mark.parametrize("garbage", [b"\xff\xfe", b"nobody", b""])
def test_a_foreign_tail_costs_a_read_of_the_line_and_no_wrong_leader(run, garbage):
    s0 = run.register("n0")
    run.client.put(run.keys.tail, garbage)  # an etcdctl put: the tail now names no agent
    e, woke = run.elect(run.register("n1"))
    assert e.check() is False
    assert len(run.sorted_reads) == 1
    assert watched(woke, s0)
    assert e.check() is True  # the oldest now
    e.close()
