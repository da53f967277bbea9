"""How long a kept worker waits for the agent's word after a collective failed (the in-place
peer wait): one lease, its fence margin and 2 s, at least 5 s; 30 s without a lease. The lease's
length comes from the liveness port's reading, which names it (``LeaseReading.ttl``) rather
than leaving the agent to add up what is left of it and how old its last keep-alive is.
"""

from __future__ import annotations

import pytest

from etcdrun.agent.in_place import InPlace
from etcdrun.agent.worker.control import PEER_WAIT_VAR
from etcdrun.rendezvous.api import LeaseReading, Liveness, LivenessPort
from etcdrun.rendezvous.client.lease import fence_margin


class Reading(LivenessPort):
    def __init__(self, reading: LeaseReading) -> None:
        self._reading = reading

    def read(self) -> LeaseReading:
        return self._reading


@pytest.mark.parametrize(
    "reading, wait",
    [
        (LeaseReading(), "30"),  # no lease (static): torch's own timeouts are all there is
        (LeaseReading(Liveness.LIVE, 0.0, 0.5, 1.2, 0.8, 2), "5.0"),  # the floor
        (LeaseReading(Liveness.LIVE, 0.0, 1.5, 3.0, 7.0, 10), "13.5"),
        # In doubt, the lease's time left and its keep-alive age no longer add up to its TTL.
        (LeaseReading(Liveness.IN_DOUBT, 0.0, 1.5, 0.0, 12.0, 10), "13.5"),
    ],
)
def test_the_peer_wait_is_one_lease_and_its_margin(reading, wait):
    assert InPlace.peer_wait(Reading(reading)) == {PEER_WAIT_VAR: wait}


def test_an_etcd_sessions_reading_names_its_lease_ttl(etcd):
    """The etcd backend's reading carries the lease's TTL once a session exists."""
    from rdzv_helpers import handler, new_run_id, shutdown_all

    h = handler(etcd.endpoints, new_run_id(), 1, 1, lease_ttl=3)
    try:
        assert h.liveness().read().ttl is None  # before the first round: no session
        h.next_rendezvous()
        assert h.liveness().read().ttl == 3
        margin = fence_margin(3)
        assert InPlace.peer_wait(h.liveness()) == {PEER_WAIT_VAR: f"{3 + margin + 2:.1f}"}
    finally:
        shutdown_all([h])
