"""RunContext: what every part of one node's etcd rendezvous works in, built once.

Why one frozen value: the driver, the leader's term, the round watch, the run gate and the
round's end (lifecycle.py) all borrow the same client, key layout, event log, round view,
protocol settings and configuration. Passed by hand, they became seven to twelve parameters
per call, and a TTL threaded through three constructors to reach the one write that needs it.
The context holds no state of its own and owns nothing: the handler owns every object in it
and builds the context once; a part keeps the context, never the handler.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcdrun.rendezvous.client import EtcdClient, RetryPolicy
from etcdrun.rendezvous.etcd.core.config import EtcdRendezvousConfig
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.etcd.core.protocol import Settings
from etcdrun.rendezvous.etcd.core.round_view import RoundView
from etcdrun.rendezvous.events import EventLog


@dataclass(frozen=True)
class RunContext:
    """One node's view of one run: ``settings`` are the protocol's (what ``decide`` reads),
    ``config`` the backend's timeouts and TTLs (design.md §7).
    """

    client: EtcdClient
    keys: RunKeys
    events: EventLog
    view: RoundView
    settings: Settings
    config: EtcdRendezvousConfig

    @property
    def policy(self) -> RetryPolicy:
        return self.client.policy


__all__ = ["RunContext"]
