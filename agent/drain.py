"""The agent's side of a drain (docs/drain.md): a request to leave the job gracefully, heard
through the rendezvous' drain port and handed to the driver as one ``loop.DrainRequested``.

Why its own object: the request arrives on a backend thread (an etcd watch) or from SIGTERM in
the signal handler, while the driver sleeps in ``_wait`` or blocks in ``next_rendezvous``. This
holds the one pending request and wakes the driver; the driver reads it between actions, and
``loop.next_step`` decides what follows (stop the workers normally, leave, exit 0). It decides
nothing itself, except whether a SIGTERM is a drain (``take_signal``) and whether a node blamed
for a hang may leave (``take_blame``).

Why a SIGTERM is decided on a thread: whether it drains or stops is the backend's word
(``DrainPort.claim``: in etcd, so that nodes signalled together agree, and a job-wide teardown
is not taken for every node draining), and no etcd call may run in a signal handler. So the
handler starts the decision and returns; the thread then drains the node, or sends the main
thread the same signal again, which the handler now takes as a stop (torchrun's meaning).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from etcdrun.agent.loop import DrainRequested
from etcdrun.rendezvous.api import DrainPort
from etcdrun.rendezvous.api import DrainRequest as Request

log = logging.getLogger(__name__)


class Drain:
    """``pending`` is the request once one came (the first wins). ``wake`` is the driver's
    wake-up (the same event a worker's exit sets).
    """

    def __init__(self, port: DrainPort, run_id: str, wake: Callable[[], None]) -> None:
        self._port = port
        self._run_id = run_id
        self._wake = wake
        self._unsubscribe: Callable[[], None] | None = None
        self._deciding = False  # a SIGTERM's decision is under way (its thread)
        self._refused = False  # decided: the SIGTERM is a stop
        self.pending: DrainRequested | None = None

    def start(self) -> None:
        self._unsubscribe = self._port.subscribe(self._heard)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def take_signal(self, signum: int, sigterm: str) -> bool:
        """In the signal handler: True when this signal may drain the node instead of stopping
        it (the decision is then under way: see the module docstring). Only SIGTERM, only with
        ``--on-sigterm drain``, only the first one, and only while the job keeps its min nodes
        without this node and the nodes signalled before it (``DrainPort.claim``): at min
        nodes a drain would stop the job all the same, and torchrun's meaning (forward, exit
        128 + 15) says so plainly. A second SIGTERM while it is decided or during the drain is
        torchrun's: the impatient sender means "now".
        """
        if signum != signal.SIGTERM or sigterm != "drain" or self.pending is not None:
            return False
        if self._refused or self._deciding:
            return False
        self._deciding = True
        main = threading.main_thread().ident
        decide = threading.Thread(
            target=self._decide, args=(main,), name="etcdrun-sigterm", daemon=True
        )
        decide.start()
        return True

    def stopped(self, by: str) -> bool:
        """This node stops on signal ``by`` (the driver, on its way out): tell the backend,
        which closes the run CANCELLED when every node of the round went so (True then, and
        said). Never an error of its own: an unreachable etcd must not hold the stop.
        """
        try:
            cancelled = self._port.stopped(by)
        except Exception as e:  # noqa: BLE001 - the stop goes on whatever the backend says
            log.info("could not record this node's stop in the rendezvous: %s", e)
            return False
        if cancelled:
            log.warning(
                "every node of run %s was stopped by a signal: the run is CANCELLED", self._run_id
            )
        return cancelled

    def _decide(self, main: int | None) -> None:
        """The SIGTERM's thread: the backend's word (its own view when it has none), then a
        drain, or the signal again for the handler to take as a stop.
        """
        try:
            verdict = self._port.claim("SIGTERM")
        except Exception as e:  # noqa: BLE001 - a SIGTERM must be taken whatever the backend does
            log.info("the rendezvous could not decide this SIGTERM: %s", e)
            verdict = None
        if verdict is None:
            verdict = self._port.room()
        if verdict:
            self._ask("SIGTERM")
            return
        self._refused = True
        if main is not None:
            signal.pthread_kill(main, signal.SIGTERM)

    def take_blame(self, by: str) -> bool:
        """From the hang watchdog's thread: this node was blamed for a hang and its workers run
        in place, so it leaves the job rather than failing the round for everyone (docs/hangs.md).
        True when it leaves (or was leaving already); False at min nodes, where leaving would stop
        the job all the same: the caller then fails the round, and the job restarts as before.
        """
        if self.pending is not None:
            return True
        if not self._port.room():
            return False
        self._ask(by)
        return True

    def _ask(self, by: str) -> None:
        """This node drains itself: pending now, and the port told (the backend stops waiting
        for a round and says it; its echo to ``_heard`` finds the request already pending).
        """
        self._set(Request(self._port.node_id(), by))
        self._port.request(by)

    def _heard(self, req: Request) -> None:
        """A backend thread: the port's request (from outside, or our own SIGTERM's echo)."""
        if self.pending is None:
            self._set(req)

    def _set(self, req: Request) -> None:
        self.pending = DrainRequested(req.by, self._run_id, req.node_id)
        self._wake()


__all__ = ["Drain"]
