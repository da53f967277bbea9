"""NodePorts: the ports one node's handler offers its agent, built together on one incarnation.

The agent talks to a backend only through the ports declared in rendezvous/api.py (liveness,
report, hang, drain, progress). On etcd each is a small object that borrows the run context and
follows the node's current incarnation (session and driver) rather than holding the handler, so
they are built in one place and live as long as the handler. Closing them stops what they run
in the background (the hang port's stack-request watch); the others hold no thread of their own
beyond what the session they borrow owns.
"""

from __future__ import annotations

from dataclasses import dataclass

from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.ports.drain import EtcdDrain
from etcdrun.rendezvous.etcd.ports.hang import EtcdHang
from etcdrun.rendezvous.etcd.ports.incarnation import Incarnation
from etcdrun.rendezvous.etcd.ports.liveness import SessionLiveness
from etcdrun.rendezvous.etcd.ports.progress import EtcdProgress
from etcdrun.rendezvous.etcd.ports.report import EtcdReport


@dataclass(frozen=True)
class NodePorts:
    """The five ports of one node; ``build`` makes them, ``close`` ends the hang port's watch."""

    liveness: SessionLiveness
    report: EtcdReport
    hang: EtcdHang
    drain: EtcdDrain
    progress: EtcdProgress

    @classmethod
    def build(cls, ctx: RunContext, now: Incarnation) -> NodePorts:
        return cls(
            liveness=SessionLiveness(now),
            report=EtcdReport(ctx, now),
            hang=EtcdHang(ctx, now),
            drain=EtcdDrain(ctx, now),
            progress=EtcdProgress(ctx, now),
        )

    def close(self) -> None:
        self.hang.close()
