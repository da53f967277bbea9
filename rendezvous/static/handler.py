"""The static backend: a fixed-size job with node ranks given up front, no etcd.

Why it exists: it is torchrun's default and what ``--standalone`` uses, so a single-node job (or a
multi-node one with ranks assigned by a scheduler) runs with nothing to install or start.

What it assumes, like torchrun's static backend: every node runs the same number of workers
(``local_world_size``), so this node's global ranks follow from its node rank alone; the node count
is ``max_nodes`` (``min_nodes`` has no meaning without a live membership).

Meeting: a job of several nodes meets on the master node before any worker starts (node rank 0
listens on ``MASTER_PORT``, the others connect; static/barrier.py), and waits for every node at
the end, as torchrun's static rendezvous does through its TCPStore; ``join_timeout`` (torchrun's
``timeout``; 600 s) bounds the meeting. A single node meets nobody.

Restarts: there is one round only. ``request_restart()`` after a worker failure re-runs it with
``restart_count + 1`` while the budget (``max_restarts``, passed by the launcher) lasts, and
closes the run with the failure once it is spent: the same contract as the etcd backend, so the
agent has one path. The count is local to this node (as in torchrun) — unlike the etcd backend,
nothing keeps it equal across nodes.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from etcdrun.rendezvous.api import (
    FailureInfo,
    Participant,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    ReportPort,
)
from etcdrun.rendezvous.errors import RendezvousClosedError, RendezvousTooManyNodesError
from etcdrun.rendezvous.free_port import reserve_free_port

# One default for every way a master address is left out (the CLI reads it from the registry
# without loading this module); re-exported here for callers of this backend.
from etcdrun.rendezvous.registry import DEFAULT_MASTER_ADDR
from etcdrun.rendezvous.static.barrier import EXIT_TIMEOUT, Member, StaticBarrier

# "rank" and "max_restarts" are set by the launcher; "join_timeout" (LaunchConfig.rdzv_timeout,
# or torchrun's "timeout", which torchrun's static backend reads) bounds the meeting. Any other
# key is a mistake (most likely an etcd key with the wrong --rdzv-backend), so it is refused
# rather than ignored.
_KNOWN_KEYS = frozenset({"rank", "join_timeout", "timeout", "max_restarts"})
DEFAULT_JOIN_TIMEOUT = 600.0  # torch's static default; etcd's join_timeout default too


def parse_static_endpoint(endpoint: str) -> tuple[str, int | None]:
    """Split ``host:port`` (``[v6]:port``, ``host``, or empty) into (host, port or None).

    An empty host means 127.0.0.1; a missing port or port 0 means "reserve a free one".
    """
    text = endpoint.strip()
    if not text:
        return DEFAULT_MASTER_ADDR, None
    malformed = ValueError(f"malformed static rendezvous endpoint {endpoint!r}: expected host:port")
    host, port_text = text, ""
    if text.startswith("["):
        host, closed, tail = text[1:].partition("]")
        if not closed or (tail and not tail.startswith(":")):
            raise malformed
        port_text = tail[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    # More than one colon without brackets: a bare IPv6 address, no port.
    if not host or any(c.isspace() for c in host) or "/" in host:
        raise malformed
    if not port_text:
        return host, None
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(
            f"malformed static rendezvous endpoint {endpoint!r}: port {port_text!r} "
            "is not in 0..65535"
        )
    port = int(port_text)
    return host, (port or None)


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets so that the colon stays unambiguous."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _node_rank(params: RendezvousParameters) -> int:
    value: Any = params.config.get("rank", params.node_rank)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"static rendezvous: rank {value!r} is not an integer") from None


def _join_timeout(params: RendezvousParameters) -> float:
    key = "join_timeout" if "join_timeout" in params.config else "timeout"
    value: Any = params.config.get(key, DEFAULT_JOIN_TIMEOUT)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"static rendezvous: {key} {value!r} is not a number of seconds > 0")
    return seconds


def _max_restarts(params: RendezvousParameters) -> int:
    value: Any = params.config.get("max_restarts", 0)
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise ValueError(f"static rendezvous: max_restarts {value!r} is not a count >= 0")
    return n


class _MeetingReport(ReportPort):
    """What the static backend tells: where the meeting on the master node stands."""

    def __init__(self, barrier: StaticBarrier) -> None:
        self._barrier = barrier

    def status(self) -> str:
        return self._barrier.status


class StaticRendezvousHandler(RendezvousHandler):
    """One fixed round; membership never changes, so ``membership_changed`` is never set."""

    def __init__(self, params: RendezvousParameters) -> None:
        unknown = sorted(set(params.config) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(
                f"unknown static rendezvous option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_KNOWN_KEYS))}"
            )
        self._run_id = params.run_id
        self._node_rank = _node_rank(params)
        self._node_count = params.max_nodes
        self._node_id = f"node{self._node_rank}"
        if not 0 <= self._node_rank < self._node_count:
            raise RendezvousTooManyNodesError(
                f"node rank {self._node_rank} is outside the static job's "
                f"{self._node_count} node(s) (valid ranks 0..{self._node_count - 1})",
                run_id=self._run_id,
                round=0,
                node=self._node_id,
            )
        self._local_world_size = params.local_world_size
        host, port = parse_static_endpoint(params.endpoint)
        self._master_addr = host
        self._master_port = port if port is not None else reserve_free_port()
        self._local_addr = params.local_addr or socket.gethostname()
        self._max_restarts = _max_restarts(params)
        self._join_timeout = _join_timeout(params)
        me = Member(
            self._run_id,
            self._node_rank,
            self._node_count,
            self._local_world_size,
            socket.gethostname(),
        )
        self._barrier = StaticBarrier(me, self._master_addr, self._master_port)
        self._report = _MeetingReport(self._barrier)
        self._lock = threading.Lock()
        self._restart_count = 0
        self._failure: FailureInfo | None = None
        self._closed = False
        self._shut_down = False
        self._changed = threading.Event()

    def get_backend(self) -> str:
        return "static"

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def master_addr(self) -> str:
        return self._master_addr

    @property
    def master_port(self) -> int:
        return self._master_port

    def _participants(self) -> tuple[Participant, ...]:
        # Only rank 0's address (the master) and our own are known; others are left empty.
        def addr(rank: int) -> str:
            if rank == 0:
                return self._master_addr
            return self._local_addr if rank == self._node_rank else ""

        return tuple(
            Participant(
                node_id=f"node{r}",
                node_rank=r,
                local_world_size=self._local_world_size,
                addr=addr(r),
                first_global_rank=r * self._local_world_size,
            )
            for r in range(self._node_count)
        )

    def next_rendezvous(self) -> RendezvousInfo:
        with self._lock:
            if self._closed or self._shut_down:
                why = "closed" if self._closed else "shut down"
                raise RendezvousClosedError(
                    f"the static rendezvous is {why}",
                    run_id=self._run_id,
                    round=0,
                    node=self._node_id,
                )
            restart_count = self._restart_count
        self._barrier.meet(self._join_timeout)  # once: every node, before any worker starts
        return RendezvousInfo(
            run_id=self._run_id,
            round=0,
            node_id=self._node_id,
            node_rank=self._node_rank,
            node_count=self._node_count,
            first_global_rank=self._node_rank * self._local_world_size,
            world_size=self._node_count * self._local_world_size,
            master_addr=self._master_addr,
            master_port=self._master_port,
            restart_count=restart_count,
            participants=self._participants(),
            max_restarts=self._max_restarts,
        )

    def is_closed(self) -> bool:
        with self._lock:
            return self._closed

    def set_closed(self) -> None:
        with self._lock:
            self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def report(self) -> ReportPort:
        return self._report

    def exit_barrier(self, timeout: float | None = None) -> bool:
        """Wait until every node's workers are done (torchrun's agents do, on their store); a
        node that failed for good has left, so nobody waits for it.
        """
        return self._barrier.exit_barrier(EXIT_TIMEOUT if timeout is None else timeout)

    def request_restart(self, reason: str, failure: FailureInfo | None = None) -> bool:
        """Re-run the round while the budget lasts; then close the run with the failure."""
        with self._lock:
            if self._closed:
                return False
            if self._restart_count < self._max_restarts:
                self._restart_count += 1
                return True
            self._closed, self._failure = True, failure
            return False

    def close_with_failure(self, failure: FailureInfo) -> None:
        with self._lock:
            self._closed = True
            if self._failure is None:
                self._failure = failure

    def closed_failure(self) -> FailureInfo | None:
        with self._lock:
            return self._failure

    @property
    def membership_changed(self) -> threading.Event:
        return self._changed

    def shutdown(self) -> bool:
        with self._lock:
            self._shut_down = True
        self._barrier.close()
        return True


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    return StaticRendezvousHandler(params)


__all__ = [
    "DEFAULT_MASTER_ADDR",
    "StaticRendezvousHandler",
    "create_rdzv_handler",
    "format_endpoint",
    "parse_static_endpoint",
]
