"""The static backend's meeting point: a multi-node static job meets on the master node before
any worker starts, and again when its workers are done.

Why: torchrun's static rendezvous makes the nodes meet through a TCPStore on
``MASTER_ADDR:MASTER_PORT`` (node rank 0 hosts it) before any worker starts, and its agents
wait for each other at the end (an exit barrier on the same store). A static backend that
started each node's workers at once left the workers to find out, and said "waiting for the
other nodes" at the end without waiting.

Why our own few lines of text over TCP, not a TCPStore: the agent stays free of torch.
Why on ``MASTER_PORT`` itself: it is the one port the user gave the job on the master (a
firewall lets it through), and nothing else uses it before the workers start: node 0 closes
its listener before it starts its own workers, and worker rank 0 then binds the port for the
workers' store. The accepted connections stay open for the exit barrier, so that nobody has to
connect again to a port the workers' store may hold by then; a peer that dies closes its end,
so the barrier learns of it at once. torch's TCPStore binds with SO_REUSEADDR and starts with
such connections open (checked with its libuv and its classic server); a worker program that
binds ``MASTER_PORT`` without SO_REUSEADDR would get EADDRINUSE on node 0.

The protocol (one line each): the server speaks first (``ETCDRUN-STATIC 1``), so a client that
reached some other program on the port never sends it anything; the client says ``HELLO
<run id> <node rank> <nnodes> <nproc per node> <host>``; the server answers ``ERR <reason>``
(and the client stops with it) or, once every rank is there, ``GO`` to all. At the end each
client sends ``DONE`` and waits for ``ALL``; node 0 sends ``ALL`` once every peer said ``DONE``.

What it costs, against torchrun's static rendezvous: bench/static_meeting.py
(bench/results/static_meeting.md). A waiting node retries a refused connect every 20 ms doubling to
200 ms, so it goes on at most ~0.2 s after node 0 listens.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from etcdrun.rendezvous.errors import RendezvousError, RendezvousTimeoutError

BANNER = b"ETCDRUN-STATIC 1\n"
BANNER_WAIT = 5.0  # a peer that accepted but says nothing in this long is not node 0's agent
EXIT_TIMEOUT = 300.0  # torch's exit_barrier_timeout
_RETRY_MIN, _RETRY_MAX = 0.02, 0.2  # a refused connect costs a SYN and a RST


@dataclass(frozen=True)
class Member:
    """What a node tells node 0 about itself; every node of a job must agree on the rest."""

    run_id: str
    node_rank: int
    node_count: int
    local_world_size: int
    host: str

    def hello(self) -> bytes:
        return (
            f"HELLO {self.run_id} {self.node_rank} {self.node_count} "
            f"{self.local_world_size} {self.host}\n"
        ).encode()


def _parse_hello(line: bytes) -> Member | None:
    parts = line.decode(errors="replace").split()
    if len(parts) != 6 or parts[0] != "HELLO":
        return None
    try:
        return Member(parts[1], int(parts[2]), int(parts[3]), int(parts[4]), parts[5])
    except ValueError:
        return None


def _mismatch(ours: Member, peer: Member) -> str | None:
    """Why ``peer`` cannot be in our job (None: it can)."""
    if peer.run_id != ours.run_id:
        return f"node 0 runs job {ours.run_id!r}, not {peer.run_id!r}"
    if peer.node_count != ours.node_count:
        return f"node 0 has --nnodes {ours.node_count}, node {peer.node_rank} has {peer.node_count}"
    if peer.local_world_size != ours.local_world_size:
        return (
            f"node 0 has --nproc-per-node {ours.local_world_size}, node {peer.node_rank} has "
            f"{peer.local_world_size} (the static backend needs the same on every node)"
        )
    if not 0 < peer.node_rank < ours.node_count:
        return f"node rank {peer.node_rank} is not in 1..{ours.node_count - 1}"
    return None


class _Lines:
    """A socket read line by line, with a deadline per read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def readline(self, deadline: float) -> bytes:
        """One line (without its newline); b"" at end of stream; TimeoutError at the deadline."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:  # socket.timeout
                raise
            except OSError:
                data = b""
            if not data:
                return b""
            self.buf += data
            if len(self.buf) > 65536:
                return b""
        line, _, self.buf = self.buf.partition(b"\n")
        return line


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def _listen(port: int) -> socket.socket:
    """Listen on every interface, as TCPStore does (IPv6 and IPv4 where both exist)."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(
            ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128
        )
    return socket.create_server(("", port), backlog=128)  # SO_REUSEADDR set by create_server


class StaticBarrier:
    """One node's side of the meeting; ``meet()`` once, ``exit_barrier()`` at the end.

    ``status`` is a line for the agent's waiting message (read from another thread).
    """

    def __init__(self, me: Member, master_addr: str, master_port: int) -> None:
        self.me = me
        self.addr, self.port = master_addr, master_port
        self.status = ""
        self._peers: list[_Lines] = []  # node 0: one per other node; else: the one to node 0
        self._met = False

    def _error(self, message: str, kind: type[RendezvousError] = RendezvousError):
        return kind(message, run_id=self.me.run_id, round=0, node=f"node{self.me.node_rank}")

    # ---- meeting ---------------------------------------------------------------------------
    def meet(self, timeout: float) -> None:
        """Return once every node of the job is here; raise after ``timeout`` seconds."""
        if self._met or self.me.node_count == 1:
            return
        deadline = time.monotonic() + timeout
        if self.me.node_rank == 0:
            self._host(deadline, timeout)
        else:
            self._join(deadline, timeout)
        self._met = True
        self.status = ""

    def _host(self, deadline: float, timeout: float) -> None:
        try:
            listener = _listen(self.port)
        except OSError as e:
            raise self._error(
                f"static rendezvous: cannot listen on MASTER_PORT {self.port} on node 0 "
                f"({e.strerror or e}): is another job or a leftover worker using it? "
                "Pick another --master-port"
            ) from None
        waiting: dict[socket.socket, tuple[_Lines, float]] = {}  # said hello? not yet
        ranks: dict[int, _Lines] = {}
        with listener, selectors.DefaultSelector() as sel:
            sel.register(listener, selectors.EVENT_READ)
            try:
                while len(ranks) < self.me.node_count - 1:
                    self._host_step(listener, sel, waiting, ranks, deadline, timeout)
            except BaseException:
                for lines in [*ranks.values(), *(w for w, _ in waiting.values())]:
                    lines.sock.close()
                raise
            for lines, _ in waiting.values():
                lines.sock.close()
        self._peers = [ranks[r] for r in sorted(ranks)]
        for peer in self._peers:
            _send(peer.sock, b"GO\n")

    def _host_step(
        self,
        listener: socket.socket,
        sel: selectors.BaseSelector,
        waiting: dict,
        ranks: dict[int, _Lines],
        deadline: float,
        timeout: float,
    ) -> None:
        """One wait of node 0: accept newcomers, read their HELLOs, drop the silent ones."""
        self._host_status(ranks)
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(set(range(1, self.me.node_count)) - set(ranks))
            raise self._error(
                f"static rendezvous: node rank(s) {', '.join(map(str, missing))} "
                f"did not arrive at port {self.port} within {timeout:g} s",
                RendezvousTimeoutError,
            )
        for key, _ in sel.select(min(left, 1.0)):
            if key.fileobj is listener:
                self._accept(listener, sel, waiting)
            else:
                self._greet(key.fileobj, sel, waiting, ranks)  # type: ignore[arg-type]
        self._drop_silent(sel, waiting)

    def _host_status(self, ranks: dict[int, _Lines]) -> None:
        missing = sorted(set(range(1, self.me.node_count)) - set(ranks))
        self.status = (
            f"static: node 0 waits on port {self.port} for node rank(s) "
            f"{', '.join(map(str, missing))} ({len(ranks) + 1} of {self.me.node_count} here)"
        )

    @staticmethod
    def _accept(listener: socket.socket, sel: selectors.BaseSelector, waiting: dict) -> None:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        if _send(sock, BANNER):
            sel.register(sock, selectors.EVENT_READ)
            waiting[sock] = (_Lines(sock), time.monotonic() + BANNER_WAIT)
        else:
            sock.close()

    def _greet(
        self, sock: socket.socket, sel: selectors.BaseSelector, waiting: dict, ranks: dict
    ) -> None:
        lines, _ = waiting[sock]
        try:
            line = lines.readline(time.monotonic() + 0.5)
        except TimeoutError:
            return  # half a line so far: wait for the rest
        sel.unregister(sock)
        del waiting[sock]
        peer = _parse_hello(line)
        why = "not a HELLO" if peer is None else _mismatch(self.me, peer)
        if peer is not None and why is None and peer.node_rank in ranks:
            why = f"node rank {peer.node_rank} is already here"
        if why is not None:
            _send(sock, f"ERR {why}\n".encode())
            sock.close()
            return
        assert peer is not None
        ranks[peer.node_rank] = lines

    @staticmethod
    def _drop_silent(sel: selectors.BaseSelector, waiting: dict) -> None:
        now = time.monotonic()
        for sock, (_, until) in list(waiting.items()):
            if now > until:
                sel.unregister(sock)
                del waiting[sock]
                sock.close()

    def _join(self, deadline: float, timeout: float) -> None:
        where = f"{self.addr}:{self.port}"
        self.status = f"static: node {self.me.node_rank} connecting to node 0 at {where}"
        sock = _connect(self.addr, self.port, deadline, self._set_status)
        if sock is None:
            raise self._error(
                f"static rendezvous: node 0 did not answer at {where} within {timeout:g} s "
                "(is it started, with the same --master-addr/--master-port?)",
                RendezvousTimeoutError,
            )
        lines = _Lines(sock)
        try:
            banner = lines.readline(time.monotonic() + BANNER_WAIT)
        except TimeoutError:
            banner = b""
        if banner + b"\n" != BANNER or not _send(sock, self.me.hello()):
            sock.close()
            raise self._error(
                f"static rendezvous: {where} answers, but not as node 0 of an etcdrun job "
                "(another program on that port?)"
            )
        self.status = f"static: node {self.me.node_rank} is at node 0 ({where}); waiting for all"
        try:
            answer = lines.readline(deadline)
        except TimeoutError:
            sock.close()
            raise self._error(
                f"static rendezvous: not every node arrived at {where} within {timeout:g} s",
                RendezvousTimeoutError,
            ) from None
        if answer != b"GO":
            sock.close()
            why = answer[4:].decode(errors="replace") if answer.startswith(b"ERR ") else ""
            raise self._error(f"static rendezvous: node 0 at {where} refused us: {why or 'EOF'}")
        self._peers = [lines]

    def _set_status(self, line: str) -> None:
        self.status = f"static: node {self.me.node_rank} {line}"

    # ---- the end ---------------------------------------------------------------------------
    def exit_barrier(self, timeout: float = EXIT_TIMEOUT) -> bool:
        """True once every node's workers are done; False when one left without (or time ran
        out): a node that failed for good ends its connection, so nobody waits for it.
        """
        if not self._met or self.me.node_count == 1:
            return True
        deadline = time.monotonic() + timeout
        try:
            if self.me.node_rank != 0:
                peer = self._peers[0]
                return _send(peer.sock, b"DONE\n") and peer.readline(deadline) == b"ALL"
            if all(p.readline(deadline) == b"DONE" for p in self._peers):
                return all([_send(p.sock, b"ALL\n") for p in self._peers])
        except TimeoutError:
            pass
        if self.me.node_rank == 0:
            self.close()  # the others learn at once that not everyone finished
        return False

    def close(self) -> None:
        for peer in self._peers:
            with contextlib.suppress(OSError):
                peer.sock.close()
        self._peers = []


def _connect(
    host: str, port: int, deadline: float, status: Callable[[str], None]
) -> socket.socket | None:
    """Connect, retrying a refused or unreachable address until the deadline (node 0 may start
    later); None when it never answered.
    """
    pause = _RETRY_MIN
    started = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            return socket.create_connection((host, port), timeout=min(left, 5.0))
        except OSError as e:
            why = e.strerror or type(e).__name__
            status(f"waits for node 0 at {host}:{port} ({time.monotonic() - started:.0f} s: {why})")
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, _RETRY_MAX)


__all__ = ["EXIT_TIMEOUT", "Member", "StaticBarrier"]
