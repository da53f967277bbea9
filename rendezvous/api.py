"""The rendezvous contract the agent (and a torchrun plugin) programs against.

Why an ABC and dataclasses rather than torch's classes: the agent never imports torch, yet the
names and meanings match torch.distributed.elastic.rendezvous so a user maps them one to one.
"""

from __future__ import annotations

import abc
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Participant:
    """One node of a frozen round."""

    node_id: str
    node_rank: int
    local_world_size: int
    addr: str
    first_global_rank: int
    host: str = ""  # for people ("node 2 (host-b, pid 4711) lost"); "" from an older etcdrun
    pid: int = 0


@dataclass(frozen=True)
class RendezvousInfo:
    """What one node learns from a completed round.

    ``first_global_rank`` is this node's first worker rank: its workers get
    ``first_global_rank + local_rank``. ``restart_count`` is job-wide with etcd (the same on
    every node). ``max_restarts`` is the budget the rendezvous decides with: the workers'
    ``TORCHELASTIC_MAX_RESTARTS`` and the agent's log lines read it from here, so the three can
    never disagree.
    """

    run_id: str
    round: int
    node_id: str
    node_rank: int
    node_count: int
    first_global_rank: int
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    participants: tuple[Participant, ...] = ()
    max_restarts: int = 0
    cause: RoundCause | None = None  # why this round opened (None: the backend cannot say)


@dataclass(frozen=True)
class FailureInfo:
    """The root cause of a job that failed for good, as every node reports it."""

    node_id: str
    host: str
    global_rank: int
    exit_code: int
    signal_name: str = ""
    message: str = ""
    traceback: str = ""
    timestamp: float = 0.0
    local_rank: int = -1
    pid: int = 0
    # The worker's last stderr lines: carried through etcd, so that every node can show what
    # the failing worker said even without @record (no error file, no traceback).
    stderr_tail: tuple[str, ...] = ()


@dataclass(frozen=True)
class Departure:
    """A node of the previous round that is not in this one, and why (``cause``: "lease
    expired" — lost —, "left" — its agent revoked its lease —, or "gone" when unknown)."""

    node_id: str
    cause: str = "gone"


@dataclass(frozen=True)
class RoundCause:
    """Why a round opened, as the leader decided it: every node of the round reads the same.

    Why structured and not the ``reason`` line alone: each node tells the story in its own log
    ("node 2 (host-b, pid 4711) lost: lease expired; new round 5 with 3 nodes (no restart
    charged)") from its own previous round and this, and a root cause is the failure here, never
    a worker some agent stopped itself.
    """

    reason: str = ""
    departed: tuple[Departure, ...] = ()
    arrived: tuple[str, ...] = ()
    failure: FailureInfo | None = None


_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_run_id(run_id: str) -> None:
    """A run id is a name: 1-128 letters, digits, '.', '_' or '-', and not '.' or '..'.

    Why: it is a key segment in etcd and a folder under log_dir. Measured before: ``..`` wrote
    attempt folders outside log_dir, ``"a b"`` and ``" "`` were accepted, and a 300-character id
    ended in an OSError traceback.
    """
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        raise ValueError(
            f"invalid run id {run_id!r}: use 1-128 letters, digits, '.', '_' or '-' "
            "(and not '.' or '..')"
        )


def check_node_range(min_nodes: int, max_nodes: int) -> None:
    """The one rule for a job's size, with the reference launcher's messages, in its order.

    Why one function: LaunchConfig, RendezvousParameters and the protocol's Settings each
    checked it, with three different messages for the same mistake.
    """
    if max_nodes < min_nodes:
        raise ValueError(f"max_nodes ({max_nodes}) must be >= min_nodes ({min_nodes})")
    if min_nodes <= 0:
        raise ValueError(f"min_nodes ({min_nodes}) must be positive")


@dataclass
class RendezvousParameters:
    """Everything needed to build a handler; ``config`` holds backend-specific keys."""

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    local_addr: str | None = None
    node_rank: int = 0
    local_world_size: int = 1
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        check_node_range(self.min_nodes, self.max_nodes)
        if self.local_world_size < 1:
            raise ValueError(
                f"local_world_size ({self.local_world_size}) must be a positive integer."
            )

    def get(self, key: str, default: Any = None) -> Any:
        return self.config.get(key, default)


def _no_op() -> None:
    return None


class RendezvousHandler(abc.ABC):
    """A backend's view of the job's membership, as the agent uses it.

    Lifecycle: ``next_rendezvous()`` (repeatedly: once per round) → ``shutdown()``. The handler
    pushes membership changes through ``membership_changed``: the agent waits on that event
    (together with its workers) instead of asking etcd in a loop.
    """

    @abc.abstractmethod
    def get_backend(self) -> str: ...

    @abc.abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and block until it is frozen with this node in it."""

    @abc.abstractmethod
    def is_closed(self) -> bool: ...

    @abc.abstractmethod
    def set_closed(self) -> None:
        """Mark the run finished so that late joiners fail at once."""

    @abc.abstractmethod
    def num_nodes_waiting(self) -> int:
        """Live nodes that are not in the current round (newcomers and hot spares)."""

    @property
    @abc.abstractmethod
    def membership_changed(self) -> threading.Event:
        """Set when the round this node runs in is superseded (or its session is lost)."""

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Leave gracefully (peers see it at once); True when it left cleanly."""

    def get_run_id(self) -> str:
        return ""

    # ---- what the elastic agent needs beyond torch's interface (defaults fit a backend without
    # ---- a shared round: static) ----------------------------------------------------------------
    def session_lost(self) -> bool:
        """True when this node's place in the job is gone (its etcd lease lost or presumed
        lost): its workers must stop at once, without a grace period (fencing, S4)."""
        return False

    def give_up_session(self, why: str) -> None:
        """This node's workers were fenced behind the agent's back (its warden killed them: the
        agent had fallen silent past its fence deadline): its place in the job is given up even
        if the lease lives, so that the others hear of it at once and the next join registers
        a new node (soak seed 1591: it rejoined as itself and the others' barrier waited for
        it). Default: nothing to give up."""
        return None

    def confirm_session(self) -> bool:
        """Ask now whether this node's place in the job still holds (etcd: its lease lives);
        False means ``session_lost()``. Why: the agent asks before stopping workers for a
        superseded round — when the cause is its own lost lease, that is fencing (no grace).
        Default: the place holds while it is not lost."""
        return not self.session_lost()

    def on_membership_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` whenever ``membership_changed`` is set; return an unsubscribe.

        Why: the agent waits on one event for its workers' exits and for membership changes
        alike, instead of polling one of them. The callback runs on a backend thread: it must
        return at once (set an event, notify a condition). Default: membership never changes.
        """
        return _no_op

    def session_in_doubt(self) -> bool:
        """True while this node's lease is in doubt: keep-alives unanswered past the fence
        deadline, yet etcd cannot have expired it. Why: an etcd leader election longer than
        the margin is not a loss — the workers pause (SIGSTOP) rather than die, and resume when
        etcd answers. Default: never."""
        return False

    def fence_margin(self) -> float:
        """Seconds from the fence deadline (pause) to the moment the lease could have expired
        (kill). Default 0: no pause, the deadline kills."""
        return 0.0

    def on_lease_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` after every keep-alive and when the lease falls in doubt (a
        backend thread; return at once); return an unsubscribe. Default: never."""
        return _no_op

    def fence_deadline(self) -> float | None:
        """The monotonic moment this node's right to run workers must be presumed lost (its
        lease may be expiring: fencing, S4), or None when the backend has no such limit."""
        return None

    def on_fence_deadline(self, callback: Callable[[float], None]) -> Callable[[], None]:
        """Call ``callback(deadline)`` whenever the fence deadline moves (after each lease
        keep-alive); return an unsubscribe. Why: a guard outside the agent's process (the
        warden) fences the workers when the agent itself is frozen and stops moving it. The
        callback runs on a backend thread and must return at once. Default: no deadline."""
        return _no_op

    def job_running(self) -> bool:
        """True when the run has a frozen round whose workers run: a node that joins now stops
        them all for a new round, so the agent first lets its standbys finish their imports
        (agent/standby/pool.py ``wait_warm``). Default False: nothing runs that a join would
        stop."""
        return False

    def round_reason(self) -> str:
        """Why the current round was opened ("node(s) left: ...", "worker rank 3 failed")."""
        return ""

    def request_restart(self, reason: str, failure: FailureInfo | None = None) -> bool:
        """Ask for a new round after a worker failure: the one path for every backend.

        The backend owns the restart budget: it either grants the restart (the next
        ``next_rendezvous()`` returns a round with ``restart_count`` + 1) or, once the budget is
        spent, closes the run with ``failure`` (the next ``next_rendezvous()`` raises
        RendezvousClosedError and ``closed_failure()`` names the root cause). etcd decides when
        the next round freezes, and a failure caused by a peer's death costs nothing. Returns
        True when this call opened the new round (False: someone else did, or the run closed).
        """
        return False

    def exit_barrier(self, timeout: float | None = None) -> bool:
        """Wait for every node of the round to finish; True when all did."""
        return True

    def close_with_failure(self, failure: FailureInfo) -> None:
        """Close the run because it failed for good, so that every node reports the root cause."""
        self.set_closed()

    def closed_failure(self) -> FailureInfo | None:
        """The failure that closed the run, once it is closed as failed."""
        return None

    def status(self) -> str:
        """One line on where the rendezvous stands, for the agent's waiting message."""
        return ""

    @property
    def use_agent_store(self) -> bool:
        """TORCHELASTIC_USE_AGENT_STORE: our workers build their own store from MASTER_*."""
        return False
