"""The rendezvous contract the agent (and a torchrun plugin) programs against.

Why an ABC and dataclasses rather than torch's classes: the agent never imports torch, yet the
names and meanings match torch.distributed.elastic.rendezvous so a user maps them one to one.
"""

from __future__ import annotations

import abc
import enum
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from etcdrun.rendezvous.listeners import Listeners

if TYPE_CHECKING:  # the contract names the event log; importing it stays lazy
    from etcdrun.rendezvous.events import EventLog


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


class DepartureCause(str, enum.Enum):
    """How a node of the previous round went. Its value is the word etcd keeps (the round's
    ``departed_cause``, read by every node and by ``etcdrun status``), so a value written by an
    older etcdrun reads the same; ``parse`` takes an unknown or empty word as GONE.
    """

    LEFT = "left"  # its agent marked itself leaving, then revoked its lease
    LEASE_EXPIRED = "lease expired"  # lost: its lease ran out
    GONE = "gone"  # not seen going (it went before this leader's term)

    @classmethod
    def parse(cls, word: str) -> DepartureCause:
        try:
            return cls(word)
        except ValueError:
            return cls.GONE


@dataclass(frozen=True)
class Departure:
    """A node of the previous round that is not in this one, and why. A backend may give the
    cause as its word ("lease expired"): it is taken as the DepartureCause it names.
    """

    node_id: str
    cause: DepartureCause = DepartureCause.GONE

    def __post_init__(self) -> None:
        if not isinstance(self.cause, DepartureCause):
            object.__setattr__(self, "cause", DepartureCause.parse(str(self.cause)))


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

    Why: it is a key segment in etcd and a folder under log_dir. Unchecked, ``..`` writes
    attempt folders outside log_dir, ``"a b"`` and ``" "`` are accepted, and a very long id ends
    in an OSError traceback.
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


class Liveness(enum.Enum):
    """This node's right to run workers, as its backend knows it (fencing, design.md S4).

    Why three values and not a flag: an etcd leader election longer than the fence margin leaves
    every lease alive (etcd renews them when a new leader takes over), yet no keep-alive is
    answered meanwhile. ``IN_DOUBT`` is that window: the workers pause (a stopped process does
    not talk) instead of dying, and resume when the backend answers again.
    """

    LIVE = "live"  # the place holds: workers run
    IN_DOUBT = "in doubt"  # unanswered past the fence deadline, not yet possibly gone: pause
    LOST = "lost"  # the place is gone (or must be presumed gone): kill, rejoin as a new node


@dataclass(frozen=True)
class LeaseReading:
    """One reading of the liveness port: what the agent, its warden and its metrics act on.

    ``deadline`` is the monotonic moment the place must be presumed in doubt (the workers are
    paused then), None when the backend has no such limit; ``margin`` runs from that moment to
    the one the place could be gone for good (the warden kills just before it). ``time_left``
    and ``keepalive_age`` are for people and metrics; ``ttl`` is the lease's whole length (how
    long a lost peer takes to be seen: the in-place peer wait); all three None without a lease.
    """

    state: Liveness = Liveness.LIVE
    deadline: float | None = None
    margin: float = 0.0
    time_left: float | None = None
    keepalive_age: float | None = None
    ttl: float | None = None


class LivenessPort:
    """How the agent learns whether it may keep its workers running, and gives its place up.

    The defaults fit a backend without a lease (static): always live, no deadline, no margin.
    A backend with a lease overrides all four; its ``subscribe`` callbacks run on a backend
    thread after every keep-alive and when the lease falls in doubt, and must return at once
    (set an event, hand a value to the warden).
    """

    def read(self) -> LeaseReading:
        return LeaseReading()

    def confirm(self) -> Liveness:
        """Ask the backend now (etcd: one LeaseTimeToLive). Why: a round superseded because
        this node's own lease vanished reaches the agent through the round watch first; telling
        the two apart decides between a stop with grace and fencing.
        """
        return self.read().state

    def give_up(self, why: str) -> None:
        """The workers were fenced behind the agent's back (its warden killed them while the
        agent was silent): give the place up even if the lease lives, so that the others hear
        of it at once and the next join registers a new node.
        """
        return None

    def subscribe(self, callback: Callable[[LeaseReading], None]) -> Callable[[], None]:
        """Call ``callback(reading)`` whenever the reading changes; return an unsubscribe."""
        return _no_op


@dataclass(frozen=True)
class LastCall:
    """The first round's last call as the backend published it, so every node says it alike."""

    deadline_unix: float  # wall clock: informational, nothing decides from it
    joined: int
    min_nodes: int
    max_nodes: int

    def seconds_left(self, now_unix: float) -> float:
        return max(0.0, self.deadline_unix - now_unix)

    def line(self, now_unix: float) -> str:
        return (
            f"first round: {self.joined} of max {self.max_nodes} joined (min {self.min_nodes}); "
            f"starting in {self.seconds_left(now_unix):.0f} s unless more join"
        )


@dataclass(frozen=True)
class KeptRound:
    """A round taken in place (design.md §4a), as the node ranked 0 in it saw it: its workers
    were handed the round instead of restarted. ``pause_s``: the longest among its kept workers,
    each from its first failed collective (or the agent's notice) to training in the new group;
    ``form_s``: the longest forming of that group; ``sync_bytes``: the most state one received
    or sent.
    """

    round: int
    previous_round: int | None
    node: str
    world_size: int
    pause_s: float | None
    form_s: float | None
    sync_bytes: int | None


class ReportPort:
    """What a backend tells about itself that the agent only reports and never acts on: its
    node id, its events, its waiting line, why the round opened, a last call, its calls to the
    store, and the rounds taken in place. The defaults tell nothing; every answer must be cheap
    and must not raise.
    """

    def node_id(self) -> str | None:
        """This node's id in the job (it may change per incarnation); None before a round."""
        return None

    def events(self) -> EventLog | None:
        """The backend's event log (docs/events.md): the agent writes it to events.jsonl and
        counts it in its metrics beside its own.
        """
        return None

    def status(self) -> str:
        """One line on where the rendezvous stands, for the agent's waiting message."""
        return ""

    def round_reason(self) -> str:
        """Why the current round was opened ("node(s) left: ...", "worker rank 3 failed")."""
        return ""

    def last_call(self) -> LastCall | None:
        return None

    def observe(self, hook: Callable[[str, float, str | None], None] | None) -> None:
        """Call ``hook(method, seconds, error)`` after every request to the backend's store
        (None stops it): the agent's request metrics. Default: no store, nothing to observe.
        """
        return None

    def kept(self, note: KeptRound) -> None:
        """Tell readers elsewhere (``etcdrun status``) that a round was taken in place. The
        agent calls it once per such round, from the node ranked 0 only, so that it costs the
        store one write per round whatever the job's size. It must return at once (it is
        called from the control channel's thread) and never raise. Default: nothing; the
        agent's own events.jsonl says it either way.
        """
        return None


@dataclass(frozen=True)
class HangNotice:
    """One message of a round's hang exchange (design.md §4b): ``kind`` is ``alarm`` (a rank
    made no progress), ``report`` (one node's stacks) or ``verdict`` (who is to blame); ``node``
    the node that posted it; ``body`` its fields, JSON values only (they travel through etcd).
    """

    kind: str
    round: int
    node: str
    body: Mapping[str, Any]


class HangPort:
    """Where the agents of one round meet about a hang (design.md §4b).

    Contract: a posted notice reaches the subscribers of every node of the run, the poster's
    own included, each once. Only the first ``alarm`` of a round is delivered: two nodes whose
    watchdogs fire together raise one alarm, so every node dumps its stacks once and one node
    (the alarm's) gives the verdict. Callbacks run on a backend thread and must return at once.

    The default is one process's: notices reach this process's subscribers only, which is all a
    backend without a shared store can do (static: each node judges its own workers). On
    connection loss the etcd port drops the notice: the round then ends the way it would
    without the watchdog (leases, the workers' own timeouts).
    """

    def __init__(self) -> None:
        self._listeners: Listeners[HangNotice] = Listeners()
        self._lock = threading.Lock()
        self._alarmed: set[int] = set()

    def post(self, notice: HangNotice) -> None:
        """Send ``notice`` to every node (here: this process only)."""
        self._receive(notice)

    def subscribe(self, callback: Callable[[HangNotice], None]) -> Callable[[], None]:
        """Call ``callback(notice)`` for every notice from now on; return an unsubscribe."""
        return self._listeners.add(callback)

    def _receive(self, notice: HangNotice) -> None:
        """A notice reached this process (posted here, or seen by a backend's watch): to the
        subscribers, a round's first alarm only.
        """
        if notice.kind == "alarm":
            with self._lock:
                if notice.round in self._alarmed:
                    return
                self._alarmed.add(notice.round)
        self._listeners.tell(notice)


@dataclass(frozen=True)
class DrainRequest:
    """This node is asked to leave the job gracefully (docs/drain.md): ``by`` says who asked,
    for people ("etcdrun drain (alice@login-1, pid 4711)", "SIGTERM").
    """

    node_id: str
    by: str


class DrainPort:
    """How a node learns that it must leave the job gracefully, and asks it of itself.

    Why a port: a drain is neither a membership change (nothing changed yet: this node is the
    one to change it) nor a failure (it charges no restart), and a backend that cannot be
    drained from outside must still let SIGTERM stop the node as torchrun does. The defaults fit
    such a backend: ``room()`` is False, so the agent never turns a signal into a drain, and
    ``request`` only tells the subscribers.

    ``subscribe`` callbacks run on a backend thread (a watch) or in a signal handler, once per
    request, and must return at once (set an event). ``request`` and ``room`` do no I/O: the
    agent calls them from its signal handler. ``claim`` and ``stopped`` may: the agent calls
    them from a thread of its own and on its way out.
    """

    def __init__(self) -> None:
        self._listeners: Listeners[DrainRequest] = Listeners()

    def subscribe(self, callback: Callable[[DrainRequest], None]) -> Callable[[], None]:
        return self._listeners.add(callback)

    def request(self, by: str) -> None:
        """This node asks to be drained itself (SIGTERM with ``room()``): the same path as a
        request from outside. A backend that waits in ``next_rendezvous`` ends that wait.
        """
        self._tell(DrainRequest(self.node_id(), by))

    def room(self) -> bool:
        """Whether the job would keep at least its min nodes without this node, as the backend
        knows it now (no I/O). Default: unknown, so no.
        """
        return False

    def claim(self, by: str) -> bool | None:
        """A signal came: whether this node drains (True) or stops (False), decided where
        every node decides it, so that nodes signalled together agree (the first ones drain
        while the job keeps its min nodes). None: the backend cannot say (the agent then takes
        ``room()``). Default: None.
        """
        return None

    def stopped(self, by: str) -> bool:
        """This node stops on a signal, not a drain (``by``: the signal): the backend records
        it, and when every node of the round has now been stopped or drained by a signal, it
        closes the run CANCELLED (a job-wide teardown). True when the run is CANCELLED.
        Default: False.
        """
        return False

    def node_id(self) -> str:
        return ""

    def _tell(self, req: DrainRequest) -> None:
        self._listeners.tell(req)


@dataclass(frozen=True)
class PaceReading:
    """One node's pace in one round, as its agent measured it over the last few seconds
    (agent/hang/pace.py): ``step`` is its slowest local worker's last step, ``step_rate`` that
    worker's steps per wall second, ``rate`` its steps per CPU-second (its own work per step:
    what names a straggler, design.md §4d).
    """

    round: int
    step: int
    step_rate: float
    rate: float


class ProgressPort:
    """Where a node's pace goes, for ``etcdrun status`` and the straggler rule (design.md §4d).

    Why a port: the agent measures (it knows its workers' pids and progress pages), the
    backend shares (etcd: one leased key per node) and decides who straggles. ``enabled()``
    tells the agent whether to measure at all: the default shares nowhere, so the agent makes
    no progress pages for it. ``publish`` runs on the agent's pace thread, at most once per
    node per 5 s; it may do I/O, and drops what it cannot send.
    """

    def enabled(self) -> bool:
        return False

    def publish(self, reading: PaceReading) -> None:
        return None


class RendezvousHandler(abc.ABC):
    """A backend's view of the job's membership, as the agent uses it.

    Lifecycle: ``next_rendezvous()`` (repeatedly: once per round) → ``shutdown()``. The handler
    pushes membership changes through ``membership_changed``: the agent waits on that event
    (together with its workers) instead of asking etcd in a loop.

    Three parts: torch's interface (the first eight members), the restart contract every backend
    keeps (``request_restart``, ``exit_barrier``, ``close_with_failure``, ``closed_failure``), and
    five narrow ports the agent asks for once: ``liveness()`` (may the workers run?),
    ``report()`` (what to tell people), ``hang()`` (where the round's hang watchdogs meet),
    ``drain()`` (must this node leave gracefully?) and ``progress()`` (where its pace goes).
    The agent uses nothing else: a new backend written against this class alone gets the
    agent's fencing, events, story lines, metrics, hang verdicts, drain and straggler report.
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

    @abc.abstractmethod
    def shutdown(self) -> bool:
        """Leave gracefully (peers see it at once); True when it left cleanly."""

    def get_run_id(self) -> str:
        return ""

    @property
    def use_agent_store(self) -> bool:
        """TORCHELASTIC_USE_AGENT_STORE: our workers build their own store from MASTER_*."""
        return False

    # ---- membership: pushed, never polled ---------------------------------------------------
    @property
    @abc.abstractmethod
    def membership_changed(self) -> threading.Event:
        """Set when the round this node runs in is superseded (or its place is lost)."""

    def on_membership_change(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` whenever ``membership_changed`` is set; return an unsubscribe.

        Why: the agent waits on one event for its workers' exits and for membership changes
        alike, instead of polling one of them. The callback runs on a backend thread: it must
        return at once (set an event, notify a condition). Default: membership never changes.
        """
        return _no_op

    def job_running(self) -> bool:
        """True when the run has a frozen round whose workers run: a node that joins now stops
        them all for a new round, so the agent first lets its standbys finish their imports
        (agent/standby/pool.py ``wait_warm``). Default False: nothing runs that a join would
        stop.
        """
        return False

    # ---- the restart contract: one path for every backend (design.md §3, L3b) --------------
    def request_restart(self, reason: str, failure: FailureInfo | None = None) -> bool:
        """Ask for a new round after a worker failure.

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

    # ---- the ports ------------------------------------------------------------------------------
    def liveness(self) -> LivenessPort:
        """This node's right to run workers. Default: no lease, always live."""
        return _NO_LEASE

    def report(self) -> ReportPort:
        """What the backend tells people. Default: nothing."""
        return _SILENT

    def hang(self) -> HangPort:
        """Where the hang watchdogs of the round's nodes meet. Default: this process only."""
        return HangPort()

    def drain(self) -> DrainPort:
        """How this node is asked to leave gracefully; asked for once, like the other ports
        (the default holds its subscribers: a new one each call). Default: never from outside,
        and SIGTERM keeps torchrun's meaning.
        """
        return DrainPort()

    def progress(self) -> ProgressPort:
        """Where this node's pace is shared. Default: nowhere (no straggler report)."""
        return _NO_PACE


_NO_LEASE = LivenessPort()
_SILENT = ReportPort()
_NO_PACE = ProgressPort()
