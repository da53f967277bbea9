"""Worker concepts of torch.distributed.elastic, under the same names, without importing torch.

Why mirror torch: a user (and the elastic loop) who knows ``WorkerSpec``, ``WorkerState``,
``RunResult`` and ``Std`` from torchrun maps them one to one. Where we differ, it is on purpose:
``WorkerSpec`` names how its entrypoint runs (``entrypoint_kind``) instead of encoding it in
``sys.executable`` tricks, and carries the console filters and the stop grace period itself.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from etcdrun.agent import flags

if TYPE_CHECKING:  # pragma: no cover - typing only; keeps this module import-light
    from etcdrun.agent.errors import ProcessFailure

__all__ = [
    "Std",
    "entrypoint_name",
    "rank_set",
    "to_map",
    "EntrypointKind",
    "WorkerState",
    "WorkerSpec",
    "Worker",
    "RunResult",
    "START_METHODS",
    "DEFAULT_SIGNALS",
    "handled_signals",
]

START_METHODS = ("spawn", "fork", "forkserver")
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's --signals-to-handle


def handled_signals(text: str) -> tuple[signal.Signals, ...]:
    """torchrun's ``--signals-to-handle`` list as signals. A name that is no signal, or one no
    process can catch, is a ValueError naming it (torch logs a warning and goes on without it:
    a job would then die of the signal it was meant to pass on).
    """
    out = []
    for item in text.split(","):
        name = item.strip().upper()
        if not name:
            continue
        sig = getattr(signal, name if name.startswith("SIG") else f"SIG{name}", None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"signals_to_handle: {item.strip()!r} is not a signal the agent can catch "
                f"(e.g. {DEFAULT_SIGNALS},SIGUSR1)"
            )
        out.append(sig)
    return tuple(dict.fromkeys(out))


SIGTERM_MEANINGS = ("drain", "stop")


def check_sigterm(value: str) -> None:
    """``on_sigterm`` is "drain" (above min nodes, SIGTERM drains this node: docs/drain.md) or
    "stop" (torchrun's meaning, always). A ValueError naming both otherwise.
    """
    if value not in SIGTERM_MEANINGS:
        raise ValueError(f"on_sigterm {value!r} must be one of {', '.join(SIGTERM_MEANINGS)}")


class Std(enum.IntFlag):
    """Which standard streams a redirect/tee applies to (torch's values: 0 none … 3 both)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parse torchrun's syntax: ``"3"`` (every local rank) or ``"0:1,1:2"`` (per local rank).

        Why a map form: a user often wants only rank 0 on the console, or only one rank's stderr.
        """
        text = vm.strip()
        if ":" not in text:
            return cls(_std_value(text, vm))
        out: dict[int, Std] = {}
        for item in text.split(","):
            rank_s, _, std_s = item.partition(":")
            try:
                rank = int(rank_s)
            except ValueError:
                raise ValueError(_std_message(vm)) from None
            if rank < 0 or not std_s:
                raise ValueError(_std_message(vm))
            out[rank] = cls(_std_value(std_s.strip(), vm))
        return out


def _std_message(vm: object) -> str:
    return (
        f"invalid redirects/tee value {vm!r}: expected 0-3 (0 none, 1 stdout, 2 stderr, 3 both)"
        " or a per-local-rank map like '0:3,1:1'"
    )


def _std_value(text: str, original: object) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(_std_message(original)) from None
    if value not in (0, 1, 2, 3):
        raise ValueError(_std_message(original))
    return value


def to_map(
    spec: Std | int | str | Mapping[int, Std | int] | None, local_world_size: int
) -> dict[int, Std]:
    """Expand a redirects/tee spec into ``{local_rank: Std}`` for every local rank.

    Local ranks missing from a map get ``Std.NONE``; ranks beyond ``local_world_size`` are ignored
    (torchrun's behaviour, so one flag value works for any ``--nproc-per-node``).
    """
    if spec is None:
        return {rank: Std.NONE for rank in range(local_world_size)}
    if isinstance(spec, str):
        spec = Std.from_str(spec)
    if isinstance(spec, Mapping):
        parsed: dict[int, Std] = {}
        for rank, value in spec.items():
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise ValueError(_std_message(dict(spec)))
            parsed[rank] = Std(_std_value(str(int(value)), dict(spec)))
        return {rank: parsed.get(rank, Std.NONE) for rank in range(local_world_size)}
    if isinstance(spec, bool) or not isinstance(spec, int):
        raise ValueError(_std_message(spec))
    value = Std(_std_value(str(int(spec)), spec))
    return {rank: value for rank in range(local_world_size)}


class EntrypointKind(str, enum.Enum):
    """How a worker runs its entrypoint: torchrun's default, -m, --no-python, --run-path.

    Why explicit: ``"train.py"`` and ``"/usr/bin/env"`` are both strings; guessing from the name
    alone is the only choice torch leaves, and it guesses wrong for an extension-less script.
    ``AUTO`` keeps the guess (callable → CALLABLE, ``*.py`` → SCRIPT, other strings → EXECUTABLE).
    """

    AUTO = "auto"
    CALLABLE = "callable"  # a Python function, run in a multiprocessing-style child
    SCRIPT = "script"  # sys.executable -u <script> args
    MODULE = "module"  # sys.executable -u -m <module> args
    EXECUTABLE = "executable"  # <entrypoint> args (PATH lookup), no interpreter
    RUN_PATH = "run_path"  # runpy.run_path(<script>) in a callable child (torchrun --run-path)


class WorkerState(str, enum.Enum):
    """State of a node's worker group (torch's names and meanings)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        """True while workers are alive (healthy or not): the agent must still wait on them."""
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


def rank_set(value: Iterable[int] | str | int | None, what: str) -> frozenset[int] | None:
    """A set of ranks from a set, one int, or a comma list ("0, 2"); None stays None (no filter).

    The one parser of rank sets: ``WorkerSpec``'s filters and ``--local-ranks-filter`` both use
    it. Empty items of a comma list are skipped; a negative or non-integer item is a ValueError
    naming ``what``.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a set of non-negative ranks, got {value!r}")
    if isinstance(value, int):
        items: Iterable[Any] = [value]
    elif isinstance(value, str):
        items = [part for part in value.replace(" ", "").split(",") if part]
    else:
        items = value
    out = set()
    for item in items:
        try:
            rank = int(item)
        except (TypeError, ValueError):
            raise ValueError(f"{what} must be non-negative integers, got {value!r}") from None
        if rank < 0:
            raise ValueError(f"{what} must be non-negative integers, got {value!r}")
        out.add(rank)
    return frozenset(out)


def entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: Iterable[Any] = ()) -> str:
    """A short name for logs and reports: the script, not "python3.11", when the interpreter
    runs one (the CLI's way: ``python -u train.py``); the function's qualified name for a
    callable. The one rule for the launcher's log line and every failure report.
    """
    if entrypoint is None:
        return "None"
    if not isinstance(entrypoint, str):
        return getattr(entrypoint, "__qualname__", repr(entrypoint))
    interpreter = entrypoint in (sys.executable, os.environ.get("PYTHON_EXEC")) or (
        os.path.basename(entrypoint).startswith("python")
    )
    if interpreter:
        script = next((str(a) for a in args if not str(a).startswith("-")), None)
        if script is not None:
            return os.path.basename(script)
    return os.path.basename(entrypoint)


@dataclass
class WorkerSpec:
    """What to run on this node and how: the same for every round of the job.

    ``rdzv_handler``, ``master_addr``/``master_port`` and ``local_addr`` are carried for the
    launcher and the rendezvous; the worker runtime takes the master address from the
    ``RendezvousInfo`` of each round, because that is what every node agreed on.
    ``local_ranks_filter``/``global_ranks_filter`` select which workers reach the console (both
    must match when both are set); filtered-out output still goes to its log file, like torchrun.

    The last fields are torch 2.13's (``duplicate_*_filters``, ``virtual_local_rank``,
    ``event_log_handler``) and the launcher's (``log_line_prefix_template``,
    ``signals_to_handle``), with torch's meanings (see ``LaunchConfig``).

    ``max_restarts``: the restart budget is job-wide and the rendezvous owns it (every node
    must count the same restarts), so None, the default, takes the rendezvous' budget. A value
    given here is a promise the agent checks at the first round: when the rendezvous' budget
    differs, the agent stops with one line naming both, rather than run with a budget other than
    the one asked for (torch's default of 3 would silently have meant the rendezvous' 0).
    ``prewarm`` defaults as ``LaunchConfig.prewarm`` does (agent/flags.py).
    """

    role: str = "default"
    local_world_size: int = 1
    rdzv_handler: Any = None
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple[Any, ...] = ()
    max_restarts: int | None = None
    monitor_interval: float = 0.1
    master_addr: str | None = None
    master_port: int | None = None
    local_addr: str | None = None
    start_method: str = "spawn"
    redirects: Std | int | str | Mapping[int, Std | int] | None = Std.NONE
    tee: Std | int | str | Mapping[int, Std | int] | None = Std.NONE
    log_dir: str | None = None
    local_ranks_filter: Iterable[int] | str | int | None = None
    global_ranks_filter: Iterable[int] | str | int | None = None
    stop_grace: float = 30.0
    entrypoint_kind: EntrypointKind | str = EntrypointKind.AUTO
    log_line_prefix_template: str | None = None
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    signals_to_handle: str = DEFAULT_SIGNALS
    event_log_handler: str = "null"
    prewarm: str = field(default_factory=lambda: flags.DEFAULT_PREWARM)  # standby workers
    restart_grace: float | None = None  # between rounds; None: agent/grace.py's default (3 s)
    hang_timeout: float | None = None  # the hang watchdog (agent/hang/); None: off
    on_sigterm: str = "drain"  # above min nodes: "drain" (leave gracefully) or "stop" (torchrun's)

    def __post_init__(self) -> None:
        if not isinstance(self.local_world_size, int) or self.local_world_size < 1:
            raise ValueError(
                f"local_world_size ({self.local_world_size}) must be a positive integer"
            )
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ValueError(f"max_restarts ({self.max_restarts}) must be non-negative")
        if self.monitor_interval < 0:
            raise ValueError("monitor_interval must be non-negative")
        if self.stop_grace < 0:
            raise ValueError(f"stop_grace ({self.stop_grace}) must be non-negative")
        if self.restart_grace is not None and self.restart_grace < 0:
            raise ValueError(f"restart_grace ({self.restart_grace}) must be non-negative")
        flags.check_hang_timeout(self.hang_timeout)
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method {self.start_method!r} is not one of {', '.join(START_METHODS)}"
            )
        handled_signals(self.signals_to_handle)
        check_sigterm(self.on_sigterm)
        self.args = tuple(self.args)
        self.local_ranks_filter = rank_set(self.local_ranks_filter, "local_ranks_filter")
        self.global_ranks_filter = rank_set(self.global_ranks_filter, "global_ranks_filter")
        # Validate now so a bad flag fails before any rendezvous, not at the first start.
        self.redirect_map()
        self.tee_map()
        try:
            kind = EntrypointKind(self.entrypoint_kind)
        except ValueError:
            kinds = ", ".join(k.value for k in EntrypointKind)
            raise ValueError(
                f"entrypoint_kind {self.entrypoint_kind!r} is not one of {kinds}"
            ) from None
        self.entrypoint_kind = kind
        if self.entrypoint is None:
            return
        resolved = self.resolved_kind()
        if resolved is EntrypointKind.CALLABLE and not callable(self.entrypoint):
            raise ValueError(f"entrypoint {self.entrypoint!r} is not callable")
        if resolved is not EntrypointKind.CALLABLE and not isinstance(self.entrypoint, str):
            raise ValueError(
                f"entrypoint_kind {resolved.value!r} needs a string entrypoint,"
                f" got {type(self.entrypoint).__name__}"
            )

    def resolved_kind(self) -> EntrypointKind:
        """The entrypoint kind with AUTO decided (see ``EntrypointKind``)."""
        kind = EntrypointKind(self.entrypoint_kind)
        if kind is not EntrypointKind.AUTO:
            return kind
        if callable(self.entrypoint) and not isinstance(self.entrypoint, str):
            return EntrypointKind.CALLABLE
        if isinstance(self.entrypoint, str) and self.entrypoint.endswith(".py"):
            return EntrypointKind.SCRIPT
        return EntrypointKind.EXECUTABLE

    def redirect_map(self) -> dict[int, Std]:
        return to_map(self.redirects, self.local_world_size)

    def tee_map(self) -> dict[int, Std]:
        return to_map(self.tee, self.local_world_size)

    def get_entrypoint_name(self) -> str:
        """A short name for messages (torch's helper of the same name; see ``entrypoint_name``)."""
        return entrypoint_name(self.entrypoint, self.args)


@dataclass
class Worker:
    """One local worker process of the current attempt.

    ``pid`` is None until started. ``role_rank``/``role_world_size`` equal the global ones: a job
    has one role.
    """

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    pid: int | None = None

    @property
    def id(self) -> int | None:
        """torch's name for the worker's process id."""
        return self.pid


@dataclass
class RunResult:
    """Outcome of one attempt on this node.

    ``return_values`` are keyed by global rank (callable entrypoints only; a script returns
    None). ``failures`` holds every worker that did not exit 0, keyed by global rank; the ones
    the agent stopped itself are in it too, flagged ``stopped_by_agent``, so that a caller can
    list them apart (``ChildFailedError`` does).
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED

    def real_failures(self) -> dict[int, ProcessFailure]:
        """Failures of the workers themselves (not those the agent stopped)."""
        from etcdrun.agent.errors import real_failures  # errors.py is not needed to build a spec

        return real_failures(self.failures)
