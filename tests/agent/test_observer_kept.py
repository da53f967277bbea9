"""The round taken in place that `etcdrun status` shows carries the longest pause of the node's
kept workers, told once they have all resumed (agent/report/observer.py).

Why: a worker blocked in a collective on a killed peer counts its pause from the kill, one
between steps only from the agent's notice. A new user's demo showed 0.06 s and 1.67 s for one
round; status printed local rank 0's figure, whichever it was.
"""

from __future__ import annotations

from etcdrun.agent.api import Worker
from etcdrun.agent.report.observer import AgentObserver
from etcdrun.rendezvous.api import KeptRound, LivenessPort, RendezvousInfo, ReportPort


class _Report(ReportPort):
    def __init__(self) -> None:
        self.kept_rounds: list[KeptRound] = []

    def kept(self, note: KeptRound) -> None:
        self.kept_rounds.append(note)


class _Handler:
    """What the observer asks of a handler: its ports and its run id."""

    def __init__(self) -> None:
        self.told = _Report()

    def report(self) -> ReportPort:
        return self.told

    def liveness(self) -> LivenessPort:
        return LivenessPort()

    def get_run_id(self) -> str:
        return "run-kept"


def _info(round_: int, node_rank: int) -> RendezvousInfo:
    return RendezvousInfo("run-kept", round_, "n0", node_rank, 2, 0, 4, "127.0.0.1", 1, 0)


def _observer(node_rank: int) -> tuple[AgentObserver, _Report]:
    handler = _Handler()
    obs = AgentObserver(handler)  # type: ignore[arg-type]
    obs.started(_info(1, node_rank), [Worker(0, 0), Worker(1, 1)], False)
    obs.regrouped(_info(2, node_rank), [Worker(0, 0), Worker(1, 1)])
    return obs, handler.told


def _resumed(obs: AgentObserver, local_rank: int, pause: float, form: float) -> None:
    obs.resumed(local_rank, {"round": 2, "pause_s": pause, "form_s": form, "sync_bytes": 2213})


def test_the_round_is_told_once_every_kept_worker_resumed_with_the_longest_pause():
    obs, told = _observer(node_rank=0)
    _resumed(obs, 0, 0.06, 0.02)
    assert told.kept_rounds == []  # local rank 1 is still re-forming
    _resumed(obs, 1, 1.67, 0.03)
    assert [(k.round, k.previous_round, k.pause_s, k.form_s) for k in told.kept_rounds] == [
        (2, 1, 1.67, 0.03)
    ]


def test_a_node_not_ranked_0_tells_nothing():
    obs, told = _observer(node_rank=1)
    _resumed(obs, 0, 0.06, 0.02)
    _resumed(obs, 1, 1.67, 0.03)
    assert told.kept_rounds == []
