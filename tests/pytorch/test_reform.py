"""A kept worker's re-form that a lost peer breaks waits for the agent's word, as a collective
does (etcdrun.elastic.runner, design.md §4a).

Why: chaos seed 2222 (tests/chaos/chaos_inplace.py) killed the rank-0 node while the survivors
formed the next group. Their form failed on its transport before etcd saw the lease expire, and
the runner took that as the script's own failure, so the node restarted its workers.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from etcdrun.agent.worker.control import ABORT, ROUND, encode
from etcdrun.elastic import runner
from etcdrun.elastic.group import Held
from etcdrun.elastic.link import AgentLink
from etcdrun.elastic.origin import Failures


def _link() -> tuple[AgentLink, socket.socket]:
    ours, agent = socket.socketpair()
    link = AgentLink(ours, on_abort=lambda: None)
    link._thread.start()
    return link, agent


def _send_round(agent: socket.socket, n: int) -> None:
    agent.sendall(encode(ROUND, round=n, env={"ETCDRUN_ROUND": n}))


def test_an_abort_of_an_earlier_round_does_not_answer_for_the_next():
    link, agent = _link()
    agent.sendall(encode(ABORT, round=0))
    _send_round(agent, 1)
    assert link.wait_round()["round"] == 1
    assert not link.interrupted()
    later = threading.Timer(0.2, lambda: agent.sendall(encode(ABORT, round=1)))
    later.start()
    assert link.await_abort(10.0)  # round 1's own notice, not round 0's left-over event
    later.join()
    link.close()
    agent.close()


class _Group:
    """Fails its first form the way a peer killed mid-form does; counts the forms."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.forms = 0
        self.inflight = None  # what the state's hook is handed; this state keeps nothing
        self.failures = Failures()  # watching no group: judges by the exception's type alone
        self.held = Held()

    def drop(self) -> None:
        pass

    def form(self, backend: str, ended: Any) -> None:
        self.forms += 1
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def check_round(self) -> None:
        pass


class _State:
    def __init__(self, commits: int = 1, rewrap_error: Exception | None = None) -> None:
        self.commits = commits
        self.rewrap_error = rewrap_error

    def restore(self) -> None:
        pass

    def rewrap(self) -> None:
        if self.rewrap_error is not None:
            raise self.rewrap_error

    def attach(self, inflight: object) -> None:
        pass

    def sync(self) -> int:
        return 0

    def reset(self) -> None:
        pass


def _peer_lost() -> Exception:
    import torch.distributed as dist

    return dist.DistNetworkError("Connection reset by peer")


def test_a_form_broken_by_a_lost_peer_forms_the_next_round(torch_available, monkeypatch):
    monkeypatch.setenv("ETCDRUN_PEER_WAIT", "10")
    link, agent = _link()
    _send_round(agent, 1)
    group = _Group(_peer_lost())

    def agent_side() -> None:  # the lease expires: round 1 is over, round 2 is handed over
        agent.sendall(encode(ABORT, round=1))
        _send_round(agent, 2)

    later = threading.Timer(0.2, agent_side)
    later.start()
    runner._reform(_State(), group, link, "gloo", check_first=True)
    later.join()
    assert (group.forms, link.round) == (2, 2)
    link.close()
    agent.close()


@pytest.mark.parametrize("why", ["the script's own", "no word from the agent"])
def test_a_re_form_that_fails_otherwise_is_the_script_failure(torch_available, monkeypatch, why):
    """A script's error in the re-form (its module in DDP's constructor) fails at once, whatever
    its text; a form broken on its transport fails once the agent has not ended the round
    within the peer wait.
    """
    monkeypatch.setenv("ETCDRUN_PEER_WAIT", "0.3" if why != "the script's own" else "30")
    link, agent = _link()
    _send_round(agent, 1)
    if why == "the script's own":
        error: Exception = ValueError("Connection reset by peer: NCCL error in the script's module")
        state, group = _State(rewrap_error=error), _Group(None)
    else:
        error = _peer_lost()
        state, group = _State(), _Group(error)
    began = time.monotonic()
    with pytest.raises(type(error)):
        runner._reform(state, group, link, "gloo", check_first=False)
    if why == "the script's own":  # at once: not after the 30 s peer wait
        assert time.monotonic() - began < 10
    link.close()
    agent.close()


@pytest.mark.parametrize("commits", [0, 3])
def test_a_re_form_without_any_commit_says_so(torch_available, caplog, commits):
    """A script that forgot ``commit()`` goes back to its start at every change: one line says
    why (a new user's trial lost all its steps twice without a word).
    """
    link, agent = _link()
    _send_round(agent, 1)
    with caplog.at_level("WARNING", logger="etcdrun.elastic"):
        runner._reform(_State(commits), _Group(None), link, "gloo", check_first=True)
    said = [r.getMessage() for r in caplog.records if "state.commit()" in r.getMessage()]
    assert len(said) == (1 if commits == 0 else 0), said
    link.close()
    agent.close()
