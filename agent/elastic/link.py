"""AgentLink: a worker's end of its agent's control channel (agent/worker/control.py).

Why a thread of its own: the notice that the round is over must act while the main thread is
blocked inside a collective on a departed or frozen peer. The thread reads the channel and, on
``abort``, marks the link interrupted and calls ``on_abort`` (the group's ``release``: it shuts
the group's sockets, so the blocked call raises within milliseconds). The main thread notices at
its next collective or its next ``commit()`` and asks ``wait_round()`` for what comes next.

Connection loss: the agent ends first only when it is killed or stops its workers; then the
worker gets its signal or its parent-death signal as without this link, and ``wait_round``
raises instead of waiting for a round that will not come.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from etcdrun.agent.worker.control import (
    ABORT,
    FINISHED,
    HELLO,
    RESUMED,
    ROUND,
    connect,
    decode,
    encode,
)


class AgentGone(RuntimeError):
    """The agent closed the channel while this worker waited for a round."""


class AgentLink:
    """``open()`` → ``hello()`` → (``interrupted()`` / ``wait_round()`` / ``resumed()``)*."""

    def __init__(self, sock: socket.socket, on_abort: Callable[[], None]) -> None:
        self._sock = sock
        self._on_abort = on_abort
        self._rounds: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._aborted: int | None = None  # the round the agent said is over
        self._abort_came = threading.Event()
        self.interrupted_at: float | None = None  # monotonic: when that notice came
        self.round = int(os.environ.get("ETCDRUN_ROUND", "0"))
        self._thread = threading.Thread(target=self._read, name="etcdrun-link", daemon=True)

    @classmethod
    def open(cls, on_abort: Callable[[], None]) -> AgentLink | None:
        """Connected to this worker's agent, or None outside an etcdrun agent."""
        sock = connect()
        if sock is None:
            return None
        link = cls(sock, on_abort)
        link._thread.start()
        return link

    def hello(self) -> None:
        """Opt in: from now on the agent hands this worker the next round instead of stopping
        it (agent/elastic_agent.py).
        """
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._send(HELLO, local_rank=local_rank, pid=os.getpid(), round=self.round)

    def interrupted(self) -> bool:
        """The agent said the round this worker runs in is over."""
        with self._lock:
            return self._aborted is not None and self._aborted >= self.round

    def await_abort(self, timeout: float) -> bool:
        """Whether the agent says, within ``timeout``, that the round is over. Why: a peer that
        was killed closes its sockets at once, so the survivors' collectives fail before etcd
        has seen its lease expire; the failure is a membership change only if the round ends.
        """
        if self.interrupted():
            return True
        self._abort_came.wait(timeout)
        return self.interrupted()

    def paused_since(self, monotonic: float) -> None:
        """The pause began at ``monotonic`` (a collective failed before the agent's notice)."""
        with self._lock:
            if self.interrupted_at is None or monotonic < self.interrupted_at:
                self.interrupted_at = monotonic

    def wait_round(self) -> dict[str, Any]:
        """Block until the agent hands over the next round; its ``env`` goes into os.environ."""
        msg = self._rounds.get()
        if msg is None:
            raise AgentGone("the agent closed the control channel")
        with self._lock:
            self.round = int(msg["round"])
            if self._aborted is None or self._aborted < self.round:
                self._abort_came.clear()  # a notice of an earlier round says nothing of this one
        os.environ.update({k: str(v) for k, v in msg["env"].items()})
        return msg

    def finished(self) -> None:
        """The training function returned: the process exits next. A round that changes
        meanwhile (a newcomer as training ends) must not restart it (agent/in_place.py).
        """
        try:
            self._send(FINISHED, round=self.round)
        except OSError:  # the agent is gone: nothing to tell
            pass

    def resumed(self, **figures: Any) -> None:
        """Training goes on in the new round: say how long it paused (events, status)."""
        with self._lock:
            self._aborted, started, self.interrupted_at = None, self.interrupted_at, None
            self._abort_came.clear()
        pause = time.monotonic() - started if started is not None else 0.0
        self._send(RESUMED, round=self.round, pause_s=round(pause, 4), **figures)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _send(self, op: str, **fields: Any) -> None:
        self._sock.sendall(encode(op, **fields))

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._rounds.put(None)
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._take(decode(line))

    def _take(self, msg: dict[str, Any]) -> None:
        if msg["op"] == ABORT:
            with self._lock:
                if int(msg["round"]) < self.round:
                    return  # a notice about a round this worker already left
                self._aborted = int(msg["round"])
                if self.interrupted_at is None:
                    self.interrupted_at = time.monotonic()
            self._on_abort()
            self._abort_came.set()
        elif msg["op"] == ROUND:
            self._rounds.put(msg)


__all__ = ["AgentGone", "AgentLink"]
