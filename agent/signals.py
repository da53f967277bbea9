"""What a signal to the agent means, and when it may act (README, "Signals").

torchrun's meaning first (``--signals-to-handle``: SIGTERM, SIGINT, SIGHUP, SIGQUIT by
default): the signal is forwarded to the workers, then SIGKILL after the grace
(``--shutdown-timeout``); the agent leaves the rendezvous and raises SignalException, which the
CLI turns into exit code 128 + signal. One exception (docs/drain.md): SIGTERM while the job has
more than min nodes drains the node instead (``--on-sigterm drain``, the default) — spot
preemption, a Slurm ``--signal`` and a Kubernetes pod deletion all send SIGTERM and mean "this
node goes away", not "the job stops".

Why a gate: starting and stopping workers and the fenced restart request are critical
sections; a signal there is held (``holding``) and raised as soon as the section ends, so that
no worker is half started and no Txn half sent. A drain needs no such care: it only sets a flag
the driver reads between actions.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from etcdrun.agent.api import handled_signals
from etcdrun.agent.drain import Drain


class SignalException(Exception):
    """The agent got a termination signal; ``sigval`` is it (exit code 128 + sigval)."""

    def __init__(self, msg: str, sigval: signal.Signals) -> None:
        super().__init__(msg)
        self.sigval = sigval


class SignalGate:
    """The agent's handlers for ``signals`` (torch's ``signals_to_handle`` string); ``sigterm``
    is "drain" or "stop" (``--on-sigterm``).
    """

    def __init__(self, signals: str, drain: Drain, sigterm: str = "drain") -> None:
        self._signals = signals
        self._drain = drain
        self._sigterm = sigterm
        self._held = 0  # critical sections we are inside
        self._deferred: int | None = None

    def install(self) -> dict[int, Any]:
        """Our handlers, returning the previous ones (for ``restore``)."""
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may handle signals (embedded use)
        previous = {}
        for sig in handled_signals(self._signals):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    @staticmethod
    def restore(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._drain.take_signal(signum, self._sigterm):
            return  # the driver reads the drain between actions
        if self._held:
            self._deferred = signum  # raised as soon as the critical section ends
            return
        raise SignalException(f"process {os.getpid()} got signal {signum}", signal.Signals(signum))

    def check_deferred(self) -> None:
        """Raise a signal held during a critical section, once none is running."""
        if self._deferred is not None and not self._held:
            sig, self._deferred = self._deferred, None
            raise SignalException(f"process {os.getpid()} got signal {sig}", signal.Signals(sig))

    def holding(self) -> _Holding:
        return _Holding(self)


class _Holding:
    """A critical section (starting/stopping workers, a fenced write) that a signal must not
    cut in half: the signal is held and raised right after.
    """

    def __init__(self, gate: SignalGate) -> None:
        self.gate = gate

    def __enter__(self) -> None:
        self.gate._held += 1

    def __exit__(self, *exc: object) -> None:
        self.gate._held -= 1
        if exc[0] is None:
            self.gate.check_deferred()


__all__ = ["SignalException", "SignalGate"]
