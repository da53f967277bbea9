"""The warden: a small process beside each agent that fences its workers when the agent cannot.

Why outside the agent: an agent that is frozen (SIGSTOP, a VM hiccup that stops one process, a
deadlock) cannot stop its own workers, while its lease runs out and the survivors start workers
with the same ranks: two live processes per RANK, each believing it is the one. And an agent
killed with -9 cannot stop what its workers started: a grandchild, or a setsid'd one, survives
it, adopted by init (bench/results/figures.md).

What it does, and nothing more:
- The agent hands it each worker's pidfd (over a Unix socket: no pid-reuse race) and, after every
  lease keep-alive, two moments: when its lease must be presumed lost, and when etcd could have
  expired it (TTL after the last acknowledged keep-alive was sent). When the first passes
  without a newer pair, the warden *pauses* the workers' trees (SIGSTOP: a stopped process does
  not talk) — an etcd leader election longer than the margin is not a loss, and a newer pair
  (etcd answered) resumes them (SIGCONT). When the second passes, the agent is frozen or its
  lease is gone: the warden kills them — before any survivor can be given their ranks (S4) —
  and says so.
- Every process of a worker's tree carries the agent's tag in its environment (``TAG_VAR``), so
  double-forked and setsid'd descendants are found (``sweep``) and killed with the workers: after
  every stop (the agent sweeps), at fencing, and when the agent dies (the warden sweeps, then
  exits). A process that clears its whole environment escapes the sweep; cgroups would not.

It is its own session (the agent's signals to workers' groups never reach it), has no
parent-death signal (it must outlive a SIGKILL of the agent), and uses only the standard library
(``python -I -S warden.py``: quick to start, nothing of etcdrun imported). Linux only
(pidfds).
"""

from __future__ import annotations

import math
import os
import select
import signal
import socket
import sys
import time

TAG_VAR = "ETCDRUN_NODE_TAG"  # in every worker's environment, inherited by its descendants
FENCED = b"F"  # warden -> agent: the workers were killed because the agent fell silent


def tagged(tag: str, skip: set[int] = frozenset(), var: str = TAG_VAR) -> list[int]:  # type: ignore[assignment]
    """Pids of live processes whose environment carries ``var=tag`` (bench/procs.py asks too)."""
    needle = f"{var}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(name))
    return found


def sweep(tag: str, sig: int = signal.SIGKILL, skip: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Signal every process of the tag (twice over, for what was forked meanwhile); how many."""
    skip = set(skip) | {os.getpid()}
    hit = 0
    for _ in range(2):
        pids = tagged(tag, skip)
        for pid in pids:
            try:
                os.kill(pid, sig)
                hit += 1
            except OSError:
                pass
        if not pids:
            break
    return hit


def _stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a paused container): its /proc state is T or t."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


class Warden:
    """The loop: a socket from the agent, the agent's pidfd, and one deadline."""

    def __init__(self, sock: socket.socket, agent_pid: int, tag: str) -> None:
        self.sock = sock
        self.agent_fd = os.pidfd_open(agent_pid)
        self.agent_pid = agent_pid
        self.tag = tag
        self.workers: list[int] = []  # pidfds of the current attempt's workers
        self.deadline = math.inf  # monotonic: when the agent's lease must be presumed lost
        self.kill_at = math.inf  # monotonic: when etcd could have expired it
        self.paused = False

    def run(self) -> int:
        while True:
            now = time.monotonic()
            if now >= min(self.deadline, self.kill_at) and not self._drain():
                return self.agent_died()
            now = time.monotonic()
            if now >= self.kill_at:
                self.fence()
                continue
            if now >= self.deadline and not self.paused:
                self.pause(signal.SIGSTOP)
            left = (self.kill_at if self.paused else self.deadline) - now
            timeout = None if math.isinf(left) else left
            ready, _, _ = select.select([self.sock, self.agent_fd], [], [], timeout)
            if self.agent_fd in ready:
                return self.agent_died()
            if self.sock in ready and not self.receive():
                return self.agent_died()

    def _drain(self) -> bool:
        """Take every message already sent before acting on a deadline that passed: a warden
        frozen with its node, or descheduled, wakes after its deadlines while the agent (thawed
        first, or never stopped) kept sending newer ones. Acting on the stale ones fenced a
        live lease (found by the chaos soak: bench/results/soak.md, 'Restart trials before network
        cuts'). False when the agent is gone.
        """
        while True:
            ready, _, _ = select.select([self.sock, self.agent_fd], [], [], 0)
            if self.agent_fd in ready:
                return False
            if self.sock not in ready:
                return True
            if not self.receive():
                return False

    def receive(self) -> bool:
        """One message: ``W`` + pidfds (a worker), ``T<pause> <kill>`` (the deadlines; ``Tinf
        inf``: none), ``C`` (a new attempt: forget the old pidfds). False at EOF.
        """
        try:
            msg, fds, _flags, _addr = socket.recv_fds(self.sock, 64, 16)
        except OSError:
            return False
        if not msg:
            return False
        kind, body = msg[:1], msg[1:]
        if kind == b"W":
            self.workers += fds
        elif kind == b"T":  # b"T<pause> <kill>": etcd answered (a pause, if any, ends)
            pause, _, kill = body.partition(b" ")
            self.deadline, self.kill_at = float(pause), float(kill or pause)
            if self.paused:
                self.pause(signal.SIGCONT)
        elif kind == b"C":
            self._forget()
        for fd in fds if kind != b"W" else ():
            os.close(fd)
        return True

    def fence(self) -> None:
        """The agent fell silent past its deadline: tell it first (it reads this before the
        workers' exits when it runs again), then kill the workers and their trees.
        """
        try:
            self.sock.send(FENCED)
        except OSError:
            pass
        workers = self._kill_workers()
        sweep(self.tag, skip={self.agent_pid})  # their trees (the workers are hit again: no count)
        self.deadline = self.kill_at = math.inf
        self.paused = False
        if not _stopped(self.agent_pid):
            return  # a running agent says it itself ("fenced: ..."): one line, not two
        print(  # the agent frozen: nothing else says it until it thaws
            f"etcdrun warden: agent {self.agent_pid} is frozen and its lease could have "
            f"expired; killed its {workers} worker(s) and their trees (fencing)",
            file=sys.stderr,
            flush=True,
        )

    def pause(self, sig: int) -> None:
        """SIGSTOP (the lease is in doubt) or SIGCONT (etcd answered) every worker's tree."""
        self.paused = sig == signal.SIGSTOP
        self._kill_workers(sig)
        sweep(self.tag, sig, skip={self.agent_pid})

    def agent_died(self) -> int:
        """The agent is gone: nothing of its workers may outlive it."""
        self._kill_workers()
        sweep(self.tag, skip={self.agent_pid})
        return 0

    def _kill_workers(self, sig: int = signal.SIGKILL) -> int:
        n = 0
        for fd in self.workers:
            try:
                signal.pidfd_send_signal(fd, sig)
                n += 1
            except OSError:  # already gone
                pass
        return n

    def _forget(self) -> None:
        for fd in self.workers:
            os.close(fd)
        self.workers = []


SEND_WAIT = 0.5  # seconds the agent waits on a full socket to its warden


class Link:
    """The agent's end: start the warden, feed it, read its word. One per agent."""

    def __init__(self, tag: str) -> None:
        import subprocess

        self.tag = tag
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = mine
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                os.path.abspath(__file__),
                str(os.getpid()),
                tag,
                str(theirs.fileno()),
            ],
            pass_fds=[theirs.fileno()],
            start_new_session=True,  # our killpg of worker groups never reaches it
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock.setblocking(False)
        self._said = False  # a failed delivery is said once

    def fileno(self) -> int:
        return self.sock.fileno()

    def worker(self, pidfd: int) -> None:
        """Hand over a (dup of a) worker's pidfd: the warden can kill it, and only it."""
        self._send(b"W", [pidfd])

    def deadline(self, monotonic: float, kill_at: float | None = None) -> None:
        """Pause the workers at ``monotonic`` unless a newer pair comes; kill at ``kill_at``
        (default: at once at ``monotonic``, no pause).
        """
        kill = monotonic if kill_at is None else kill_at
        self._send(b"T" + repr(float(monotonic)).encode() + b" " + repr(float(kill)).encode())

    def new_attempt(self) -> None:
        self._send(b"C")

    def fenced(self) -> bool:
        """Whether the warden said it fenced (read without blocking; the reactor asks)."""
        try:
            return self.sock.recv(16) == FENCED
        except (BlockingIOError, OSError):
            return False

    def close(self, timeout: float = 2.0) -> None:
        """Stop the warden: closing the socket is its signal to sweep and leave."""
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout)
            except Exception:
                self.proc.kill()
                self.proc.wait()

    def _send(self, msg: bytes, fds: list[int] = ()) -> None:  # type: ignore[assignment]
        """A full socket (the warden busy, or descheduled under load) is waited on briefly: a
        worker's pidfd dropped here is a worker the warden could not fence. A warden gone or
        stuck past that is said once; the agent goes on (and fences itself while it runs).
        """
        deadline = time.monotonic() + SEND_WAIT
        while True:
            try:
                socket.send_fds(self.sock, [msg], list(fds)) if fds else self.sock.send(msg)
                return
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left > 0 and select.select([], [self.sock], [], left)[1]:
                    continue
                why = f"its socket stayed full for {SEND_WAIT:g} s"
            except OSError as e:
                why = str(e)
            if not self._said:
                self._said = True
                import logging  # the warden's own side runs without it (-I -S)

                logging.getLogger(__name__).warning(
                    "warden %d: a message was not delivered (%s): it may not fence this node's "
                    "workers if the agent freezes",
                    self.proc.pid,
                    why,
                )
            return


def _main() -> int:
    agent_pid, tag, fd = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the agent's to handle
    sock = socket.socket(fileno=fd)
    if os.getppid() != agent_pid:  # the agent died before we started
        sweep(tag, skip={agent_pid})
        return 0
    return Warden(sock, agent_pid, tag).run()


if __name__ == "__main__":
    sys.exit(_main())
