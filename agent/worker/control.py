"""The local control channel between an agent and its workers: in-place rounds (design.md §4a).

Why a channel: a worker that opted in through ``etcdrun.elastic`` keeps its process and memory
through a membership change. Its agent must tell it two things the worker cannot learn alone:
at once, that the round it runs in is over (so that it releases a collective blocked on a
departed or frozen peer, instead of waiting out gloo's 30 minutes), and, once the next round is
frozen, what that round is (its new RANK, WORLD_SIZE, MASTER_*). The worker tells its agent
that it opted in and, once it trains again, how long it paused.

Why an abstract UNIX socket named after the agent's node tag: a worker started from a standby
learns the name with the round's environment, which is all it gets at the hand-over; the kernel
frees the name when the agent ends, however it ends; and ``SO_PEERCRED`` names the process on
the other end, so the agent hears only processes it started (the caller checks the pid).

Wire: one JSON object per line, ``op`` first. Worker → agent: ``hello`` (local_rank, pid,
round: it entered ``elastic.run``), ``resumed`` (round, pause_s, lost_steps, sync_bytes: it
trains in the new round), ``finished`` (its training function returned: it exits next, and a
round change while it does so is no reason to restart it). Agent → worker: ``abort`` (round:
that round is over) and ``round`` (round, env: the new round's environment, every variable the
worker would get if started now).
A connection that breaks is the worker's end (it exited); the agent then stops it the usual way.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("etcdrun.agent")

VAR = "ETCDRUN_CONTROL"  # the channel's abstract socket name, in every worker's environment
PEER_WAIT_VAR = "ETCDRUN_PEER_WAIT"  # how long a worker's failed collective awaits the verdict
HELLO, RESUMED, ABORT, ROUND = "hello", "resumed", "abort", "round"
FINISHED = "finished"  # worker -> agent: its training function returned; it exits next
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def encode(op: str, **fields: Any) -> bytes:
    return (json.dumps({"op": op, **fields}, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    msg = json.loads(line)
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ValueError(f"not a control message: {line[:80]!r}")
    return msg


def peer_pid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    return _CRED.unpack(raw)[0]


@dataclass
class _Peer:
    sock: socket.socket
    pid: int
    buf: bytes = b""
    local_rank: int | None = None
    round: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


Listener = Callable[[int, dict[str, Any]], None]


class ControlServer:
    """One per agent. ``start()`` binds ``\\0etcdrun-ctl-<tag>``; ``on_message(local_rank,
    msg)`` runs on the server's thread for every message after a worker's hello (it must
    return at once); ``opted_in(pids)`` says which local ranks of those processes said hello for
    ``round``; ``send`` writes to one worker; ``close()`` ends the thread and every connection.

    Connection loss: a worker's socket that breaks is dropped (the worker ended or will be
    stopped); a send to it returns False, and the agent falls back to stopping its workers.
    """

    def __init__(self, tag: str, on_message: Listener | None = None) -> None:
        self.name = f"\0etcdrun-ctl-{tag}"
        self._on_message = on_message
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}  # by fileno
        self._wake_r, self._wake_w = socket.socketpair()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def env(self) -> dict[str, str]:
        return {VAR: self.name[1:]}  # the worker adds the leading NUL back

    def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(self.name)
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._sel.register(listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="etcdrun-control", daemon=True)
        self._thread.start()

    def opted_in(self, pids: dict[int, int], round_number: int) -> set[int]:
        """The local ranks (of ``pids``: local rank → pid) whose process said hello in
        ``round_number`` over a connection that still holds.
        """
        with self._lock:
            return {
                p.local_rank
                for p in self._peers.values()
                if p.local_rank is not None
                and pids.get(p.local_rank) == p.pid
                and p.round == round_number
            }

    def send(self, local_rank: int, op: str, **fields: Any) -> bool:
        data = encode(op, **fields)
        with self._lock:
            peer = next((p for p in self._peers.values() if p.local_rank == local_rank), None)
        if peer is None:
            return False
        try:
            peer.sock.sendall(data)
        except OSError:
            return False
        if op == ROUND:
            peer.round = fields.get("round")
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
        self._wake_w.close()

    # ---- the server's thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            for key, _ in self._sel.select():
                if key.data == "wake":
                    return
                if key.data == "accept":
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        peer = _Peer(sock, peer_pid(sock))
        with self._lock:
            self._peers[sock.fileno()] = peer
        self._sel.register(sock, selectors.EVENT_READ, "peer")

    def _read(self, sock: socket.socket) -> None:
        peer = self._peers.get(sock.fileno())
        try:
            chunk = sock.recv(65536)
        except OSError:
            chunk = b""
        if peer is None or not chunk:
            self._drop(sock)
            return
        peer.buf += chunk
        while b"\n" in peer.buf:
            line, peer.buf = peer.buf.split(b"\n", 1)
            try:
                self._take(peer, decode(line))
            except (ValueError, TypeError) as e:
                log.warning("control channel: pid %d sent %s; closing it", peer.pid, e)
                self._drop(sock)
                return

    def _take(self, peer: _Peer, msg: dict[str, Any]) -> None:
        if msg["op"] == HELLO:
            if int(msg.get("pid", -1)) != peer.pid:
                raise ValueError(f"a hello for pid {msg.get('pid')} from pid {peer.pid}")
            with self._lock:
                peer.local_rank, peer.round = int(msg["local_rank"]), int(msg["round"])
        elif peer.local_rank is None:
            raise ValueError(f"{msg['op']!r} before hello")
        if self._on_message is not None:  # the pid the kernel names (SO_PEERCRED), not a claim
            self._on_message(peer.local_rank, {**msg, "pid": peer.pid})

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._peers.pop(sock.fileno(), None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()


def connect(environ: dict[str, str] | None = None) -> socket.socket | None:
    """The worker's end: connected to its agent's channel, or None outside an etcdrun agent
    (plain torchrun, a bare ``python`` run).
    """
    name = (os.environ if environ is None else environ).get(VAR)
    if not name:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.connect("\0" + name)
    return sock


__all__ = [
    "ABORT",
    "FINISHED",
    "HELLO",
    "PEER_WAIT_VAR",
    "RESUMED",
    "ROUND",
    "VAR",
    "ControlServer",
    "connect",
    "decode",
]
