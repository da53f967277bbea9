"""``Drain.take_blame``: a node blamed for a hang leaves only when the others keep their min.

Pure: a DrainPort written against its documented interface, no etcd. The end-to-end case (a
rank hung in place, its node leaving, the others re-forming) is tests/pytorch/test_hang.py.
"""

from __future__ import annotations

from etcdrun.agent.drain import Drain
from etcdrun.rendezvous.api import DrainPort


class Port(DrainPort):
    def __init__(self, room: bool) -> None:
        super().__init__()
        self._room = room
        self.asked: list[str] = []

    def room(self) -> bool:
        return self._room

    def node_id(self) -> str:
        return "n1"

    def request(self, by: str) -> None:
        self.asked.append(by)
        super().request(by)


def drain(room: bool) -> tuple[Drain, Port, list[int]]:
    port, woken = Port(room), []
    d = Drain(port, "run", lambda: woken.append(1))
    d.start()
    return d, port, woken


def test_with_room_the_blamed_node_leaves_and_says_who_asked():
    d, port, woken = drain(room=True)
    assert d.take_blame("the hang watchdog")
    assert (d.pending.by, d.pending.node_id, d.pending.run_id) == ("the hang watchdog", "n1", "run")
    assert port.asked == ["the hang watchdog"] and woken
    assert d.take_blame("the hang watchdog") and port.asked == ["the hang watchdog"]  # once


def test_at_min_nodes_it_stays_and_the_round_fails_as_before():
    d, port, woken = drain(room=False)
    assert not d.take_blame("the hang watchdog")
    assert d.pending is None and port.asked == [] and not woken
