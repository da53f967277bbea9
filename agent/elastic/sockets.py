"""Which TCP sockets of this process belong to a group etcdrun formed: the only ones it shuts.

Why sockets at all: a synchronous gloo collective blocked on a frozen peer is released neither
by ``ProcessGroupGloo.abort()`` nor by torch 2.14's ``_reconfigure`` called from another thread
(shared/facts.md; measured again on 2.14.1); shutting this process's ends of the group's
connections fails it at once (design.md §4a).

Why so narrowly: a worker holds connections of its own (a metrics or experiment tracker, an
object-store stream, a database), and a release must never touch them. A socket is the group's
when it appeared while etcdrun formed the group (it is new by descriptor *and* inode) and it
is one of:

- a connection of the round's store, which etcdrun built: one end at ``MASTER_PORT``;
- a gloo pair this rank accepted: its local end is the gloo listener that appeared in the form;
- a gloo pair this rank dialled: its far end is a peer's gloo listener, whose port each rank
  learns from the others in the round check's one all_gather (``peer_ports``).

A socket another thread of the script opened while the group formed is none of these. The
listeners themselves are never shut: gloo's accept thread dies on a shut listener and takes
the process with it. Each socket is shut only while its descriptor still names it (same
inode): a descriptor closed meanwhile may already name someone else's socket.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Sock:
    """One TCP socket of this process, as seen at a census."""

    inode: int
    listening: bool
    local_port: int
    peer_port: int | None


def census() -> dict[int, Sock]:
    """Every TCP socket of this process: descriptor to what it is."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
        except OSError:
            continue
        seen = _look(int(name))
        if seen is not None:
            found[int(name)] = seen
    return found


def new_since(before: dict[int, Sock], now: dict[int, Sock]) -> dict[int, Sock]:
    """The sockets of ``now`` that ``before`` did not have (a reused descriptor counts as new)."""
    old = {fd: s.inode for fd, s in before.items()}
    return {fd: s for fd, s in now.items() if old.get(fd) != s.inode}


def listener_port(new: dict[int, Sock]) -> int:
    """The port of the gloo listener among ``new`` (0 when there is none: NCCL, a failed form)."""
    ports = [s.local_port for s in new.values() if s.listening]
    return ports[0] if ports else 0


def the_groups(new: dict[int, Sock], store_port: int, peer_ports: set[int]) -> dict[int, int]:
    """The group's connected sockets among ``new``: descriptor to inode (see the module
    docstring for the rule).
    """
    listening = {s.local_port for s in new.values() if s.listening} - {store_port}
    owned = {}
    for fd, s in new.items():
        if s.listening or s.peer_port is None:
            continue
        if (
            store_port in (s.local_port, s.peer_port)
            or s.local_port in listening
            or s.peer_port in peer_ports
        ):
            owned[fd] = s.inode
    return owned


def shut(fds: dict[int, int]) -> None:
    """Shut each socket that its descriptor still names (its inode unchanged)."""
    for fd, inode in fds.items():
        s = _socket_at(fd)
        if s is None:
            continue
        with s:
            try:
                if os.fstat(s.fileno()).st_ino == inode:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _look(fd: int) -> Sock | None:
    """What the TCP socket ``fd`` names now, or None (not TCP, or closed meanwhile). It looks at
    a duplicate, so that all it reports concerns one socket whatever becomes of ``fd``.
    """
    s = _socket_at(fd)
    if s is None:
        return None
    with s:
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                return None
            listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            local_port = s.getsockname()[1]
            try:
                peer_port = None if listening else s.getpeername()[1]
            except OSError:  # not connected (yet, or any more)
                peer_port = None
            return Sock(os.fstat(s.fileno()).st_ino, listening, local_port, peer_port)
        except OSError:
            return None


def _socket_at(fd: int) -> socket.socket | None:
    try:
        return socket.socket(fileno=os.dup(fd))
    except OSError:
        return None


__all__ = ["Sock", "census", "listener_port", "new_since", "shut", "the_groups"]
