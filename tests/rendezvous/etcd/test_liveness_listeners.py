"""SessionLiveness's subscribers: an unsubscribe may be called twice (an agent that closes a
port on two paths), as every other port's.
"""

from __future__ import annotations

from etcdrun.rendezvous.etcd.ports.incarnation import Incarnation
from etcdrun.rendezvous.etcd.ports.liveness import SessionLiveness


def test_a_second_unsubscribe_is_harmless():
    port = SessionLiveness(Incarnation())
    unsubscribe = port.subscribe(lambda reading: None)
    unsubscribe()
    unsubscribe()  # raised ValueError from list.remove before it used Listeners
