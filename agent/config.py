"""``LaunchConfig``: everything one node needs to run an elastic job.

Why a plain dataclass with the reference launcher's fields, defaults and ValueError messages: code
written against torch.distributed.launcher's ``LaunchConfig`` ports by changing one import, and the
CLI, the Python API and the tests all validate through this one place.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from etcdrun.agent import flags
from etcdrun.agent.api import DEFAULT_SIGNALS, WorkerSpec, check_sigterm, handled_signals
from etcdrun.rendezvous.api import RendezvousHandler, check_node_range, check_run_id

EVENT_LOG_HANDLERS = ("null", "console", "dynamic_rendezvous")  # torch's registered handlers
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")  # torch.numa.binding.AffinityMode


@dataclass
class LaunchConfig:
    """Elastic launch settings for one node of a job.

    ``min_nodes``/``max_nodes`` bound the job's size: when they differ the job is elastic and nodes
    may join or leave within those bounds. ``rdzv_*`` select and configure the rendezvous backend
    (``rdzv_configs`` holds backend-specific keys, e.g. ``lease_ttl`` for etcd).

    ``monitor_interval`` keeps torch's meaning where etcdrun polls workers at all: a worker the
    kernel gives no exit notice for (no pidfd) is polled this often. Everything else wakes the
    agent at once (worker exits, membership changes, signals): it never polls for them, and 0
    does not make it spin.

    ``metrics_cfg`` (keys ``handler``: null, console or prometheus; ``port``: serve /healthz,
    /livez and /metrics there; ``addr``: the address to bind, default 0.0.0.0) and
    ``event_log_handler`` (null or console: events.jsonl always, the console too; torch's
    ``dynamic_rendezvous`` acts as null) are the
    reference's fields, given a meaning here (agent/report/metrics.py, agent/report/event_sink.py).

    ``local_ranks_filter``, ``stop_grace``, ``entrypoint_kind`` and ``restart_grace`` are ours,
    not the reference's; their defaults change nothing but the last:
    ``local_ranks_filter`` (only these local ranks' output reaches the console; None: all),
    ``stop_grace`` (seconds between SIGTERM and SIGKILL when stopping workers; None: the agent's
    default, 30 s like torchrun) and ``entrypoint_kind`` (how a string entrypoint runs: "auto"
    guesses like torch; the CLI says exactly, e.g. "executable" for ``--no-python``; see
    ``etcdrun.agent.api.EntrypointKind``) and ``restart_grace`` (the grace of a stop between
    rounds — a membership change, a superseded round, a restart after a failure —; None: 3 s,
    see agent/grace.py; the job's end keeps ``stop_grace``).

    After them, torch 2.13's newer fields under torch's names, defaults and meanings:
    ``logs_specs`` (a LogsSpecs object: its log_dir, redirects, tee and local_ranks_filter are
    used where ours are unset, its file layout is not; a name from ``--logs-specs``: said so at
    start), ``log_line_prefix_template`` (``${role_name}``, ``${rank}``, ``${local_rank}``),
    ``numa_options`` (not honoured: said so at start),
    ``signals_to_handle`` (the signals the agent catches and sends on to the workers),
    ``duplicate_stdout_filters``/``duplicate_stderr_filters`` (teed lines holding any of the
    strings also go to ``filtered_stdout.log``/``filtered_stderr.log`` of the attempt),
    ``virtual_local_rank`` (LOCAL_RANK 0, CUDA_VISIBLE_DEVICES the worker's one GPU) and
    ``shutdown_timeout`` (torch's name for ``stop_grace``: one value; else
    ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s; see ``grace()``).

    Last, ours again: ``hang_timeout`` (seconds without progress before the hang watchdog ends
    the round, with every worker's stack; None, the default: off; docs/hangs.md),
    ``on_sigterm`` ("drain", the default, or "stop"): what SIGTERM means while the job
    has more than its min nodes — this node leaves gracefully (docs/drain.md), or torchrun's
    forward-and-exit-143, which it always means at min nodes (agent/signals.py); and
    ``evict_stragglers`` (False, the default: stragglers are only named): passed to the
    rendezvous as its ``evict_stragglers`` setting, so that the leader asks a straggler to leave
    (docs/hangs.md, "Stragglers").
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "static"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: Any = None
    tee: Any = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    # etcdrun's own additions (keep them last so positional construction matches the reference).
    local_ranks_filter: set[int] | None = None
    stop_grace: float | None = None
    entrypoint_kind: str = "auto"
    prewarm: str = field(default_factory=lambda: flags.DEFAULT_PREWARM)
    restart_grace: float | None = None
    # torch 2.13's newer fields, after ours (see the class docstring).
    logs_specs: Any = None
    log_line_prefix_template: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = DEFAULT_SIGNALS
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: float | None = None
    # Ours again, after torch's (positional construction keeps matching the reference).
    hang_timeout: float | None = None  # agent/hang/ (None: off)
    on_sigterm: str = "drain"
    evict_stragglers: bool = False  # the leader drains a straggler (rdzv evict_stragglers)

    def __post_init__(self) -> None:
        # Same checks, same order and same messages as the reference launcher. The node range
        # is the rendezvous' one rule (check_node_range: max >= min, then min > 0); the
        # reference checks nproc_per_node between those two, hence the guarded check first.
        if self.nproc_per_node <= 0 and self.max_nodes >= self.min_nodes:
            raise ValueError(f"nproc_per_node ({self.nproc_per_node}) must be positive")
        check_node_range(self.min_nodes, self.max_nodes)
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts ({self.max_restarts}) must be non-negative")
        if self.monitor_interval < 0:
            raise ValueError("monitor_interval must be non-negative")
        if self.node_rank < 0:
            raise ValueError(f"node_rank ({self.node_rank}) must be non-negative")
        if self.node_rank >= self.max_nodes:
            raise ValueError(
                f"node_rank ({self.node_rank}) must be smaller than max_nodes ({self.max_nodes})"
            )
        if not self.run_id:
            self.run_id = "none"
        # Ours: the id names etcd keys and a folder under log_dir.
        check_run_id(self.run_id)
        # Ours.
        if self.stop_grace is not None and self.stop_grace < 0:
            raise ValueError(f"stop_grace ({self.stop_grace}) must be non-negative")
        if self.restart_grace is not None and self.restart_grace < 0:
            raise ValueError(f"restart_grace ({self.restart_grace}) must be non-negative")
        if self.local_ranks_filter is not None and any(r < 0 for r in self.local_ranks_filter):
            raise ValueError(
                f"local_ranks_filter ({sorted(self.local_ranks_filter)}) must hold "
                "non-negative local ranks"
            )
        flags.check_hang_timeout(self.hang_timeout)
        self.prewarm = flags.parse_prewarm(self.prewarm)
        check_sigterm(self.on_sigterm)
        self._check_torch_fields()

    def _check_torch_fields(self) -> None:
        """torch 2.13's newer fields: torch's checks (shutdown_timeout) and ours, which fail at
        once where torch would fail late (an unknown handler at the end of the run) or warn
        (an unknown signal name).
        """
        self._resolve_shutdown_timeout()
        self.signals()
        if self.event_log_handler not in EVENT_LOG_HANDLERS:
            raise ValueError(
                f"event_log_handler {self.event_log_handler!r} is not one of "
                f"{', '.join(EVENT_LOG_HANDLERS)} (torch's registered handlers)"
            )
        mode = numa_mode(self.numa_options)
        if mode is not None and mode not in NUMA_MODES:
            raise ValueError(f"numa_options {mode!r} is not one of {', '.join(NUMA_MODES)}")
        for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, str) or not all(isinstance(v, str) for v in value)
            ):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
        self._adopt_logs_specs()

    def _resolve_shutdown_timeout(self) -> None:
        given, grace = self.shutdown_timeout, self.stop_grace
        if given is not None and given < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {given}")
        if given is not None and grace is not None and float(given) != float(grace):
            raise ValueError(
                f"shutdown_timeout ({given}) and stop_grace ({grace}) are one setting "
                "(the grace between the stop signal and SIGKILL): give one"
            )
        self.grace()  # a bad TORCH_ELASTIC_SHUTDOWN_TIMEOUT fails now, not when workers stop

    def grace(self) -> float | None:
        """Seconds between the stop signal and SIGKILL: ``shutdown_timeout`` (torch's name) or
        ``stop_grace`` (ours), else ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (torch's), else None (the
        agent's default, 30 s as torch's). torch writes the resolved value back into
        ``shutdown_timeout``; here the fields stay as given, so ``dataclasses.replace`` works.
        """
        value = self.shutdown_timeout if self.shutdown_timeout is not None else self.stop_grace
        raw = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        if value is not None or not raw:
            return value
        try:
            env = int(raw)
        except ValueError:
            raise ValueError(
                f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw!r}: expected whole seconds"
            ) from None
        if env < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {env}")
        return float(env)

    def _adopt_logs_specs(self) -> None:
        """A torch LogsSpecs object (the Python API's way to say log_dir/redirects/tee/filter):
        its settings are ours where ours are unset.
        """
        specs = self.logs_specs
        if specs is None or isinstance(specs, str):
            return
        if self.log_dir is None:
            self.log_dir = getattr(specs, "_root_log_dir", None)
        for ours, theirs in (("redirects", "_redirects"), ("tee", "_tee")):
            value = _std(getattr(specs, theirs, None))
            if getattr(self, ours) is None and value:
                setattr(self, ours, value)
        ranks = getattr(specs, "_local_ranks_filter", None)
        if self.local_ranks_filter is None and ranks:
            self.local_ranks_filter = set(ranks)

    def notices(self) -> list[str]:
        """One line for each setting that is accepted but not honoured here, or honoured
        otherwise than a torchrun user may think; the launcher logs them at start.
        """
        out = []
        if isinstance(self.logs_specs, str):
            out.append(
                f"--logs-specs {self.logs_specs}: not honoured: a LogsSpecs plugin is torch code "
                "and etcdrun's agent runs without torch; logs go to "
                "<log_dir>/<run_id>/attempt_<n>/<rank>/ as with torch's DefaultLogsSpecs"
            )
        elif self.logs_specs is not None and type(self.logs_specs).__name__ != "DefaultLogsSpecs":
            out.append(
                f"logs_specs {type(self.logs_specs).__name__}: its log_dir, redirects, tee and "
                "local_ranks_filter are used; its reify() (the file layout) is not"
            )
        if self.event_log_handler == "dynamic_rendezvous":
            out.append(
                "--event-log-handler dynamic_rendezvous: the events go to events.jsonl, as with "
                "null (console puts them on stderr too)"
            )
        mode = numa_mode(self.numa_options)
        if mode is not None:
            from etcdrun.agent import accelerators

            why = (
                "no GPU is visible on this node, so there is none to bind near"
                if not accelerators.gpu_count()
                else "etcdrun does not bind workers to CPUs (wrap the script in numactl)"
            )
            out.append(f"--numa-binding {mode}: not honoured: {why}")
        for std, filters in (
            ("stdout", self.duplicate_stdout_filters),
            ("stderr", self.duplicate_stderr_filters),
        ):
            if filters and not _teed(self.tee, 1 if std == "stdout" else 2):
                out.append(
                    f"--duplicate-{std}-filters: no worker's {std} is teed, so nothing is "
                    f"duplicated (as under torchrun, only teed lines are: add --tee)"
                )
        return out

    def worker_spec(
        self,
        handler: RendezvousHandler | None,
        entrypoint: Callable[..., Any] | str | None,
        args: Sequence[Any],
    ) -> WorkerSpec:
        """The WorkerSpec this node runs; ``handler`` None for its standbys, which start
        before the handler exists (agent/standby/pool.py ``early``).
        """
        extra: dict[str, Any] = {}
        grace = self.grace()  # --shutdown-timeout or --stop-grace (or torch's variable)
        if grace is not None:  # None: WorkerSpec's default (30 s, like torchrun)
            extra["stop_grace"] = grace
        extra["restart_grace"] = self.restart_grace  # None: agent/grace.py's default
        extra["hang_timeout"] = self.hang_timeout
        return WorkerSpec(
            role=self.role,
            local_world_size=self.nproc_per_node,
            rdzv_handler=handler,
            entrypoint=entrypoint,
            args=tuple(args),
            max_restarts=None,  # the rendezvous' budget: launch_agent gives it max_restarts
            monitor_interval=self.monitor_interval,
            master_addr=self.master_addr,
            master_port=self.master_port,
            local_addr=self.local_addr,
            start_method=self.start_method,
            redirects=self.redirects,
            tee=self.tee,
            log_dir=self.log_dir,
            local_ranks_filter=self.local_ranks_filter,
            entrypoint_kind=self.entrypoint_kind,
            log_line_prefix_template=self.log_line_prefix_template,
            duplicate_stdout_filters=self.duplicate_stdout_filters,
            duplicate_stderr_filters=self.duplicate_stderr_filters,
            virtual_local_rank=self.virtual_local_rank,
            signals_to_handle=self.signals_to_handle,
            on_sigterm=self.on_sigterm,
            event_log_handler=self.event_log_handler,
            prewarm=self.prewarm,
            **extra,
        )

    def signals(self) -> tuple[signal.Signals, ...]:
        """``signals_to_handle`` as signals (see ``etcdrun.agent.api.handled_signals``)."""
        return handled_signals(self.signals_to_handle)


def numa_mode(options: Any) -> str | None:
    """The affinity mode of ``numa_options``: torch's NumaOptions, or the mode's name."""
    if options is None:
        return None
    mode = getattr(options, "affinity_mode", options)
    return str(getattr(mode, "value", mode))


def _teed(tee: Any, bit: int) -> bool:
    """Whether a --tee value tees this stream (1 stdout, 2 stderr) for any local rank."""
    if tee is None:
        return False
    if isinstance(tee, str):
        from etcdrun.agent.api import Std

        tee = Std.from_str(tee)
    values = tee.values() if isinstance(tee, dict) else [tee]
    return any(int(v) & bit for v in values)


def _std(value: Any) -> Any:
    """A torch ``Std`` (or a map of them) as plain ints: the same values as ours."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {int(k): int(getattr(v, "value", v)) for k, v in value.items()} or None
    return int(getattr(value, "value", value)) or None


__all__ = ["DEFAULT_SIGNALS", "EVENT_LOG_HANDLERS", "LaunchConfig", "NUMA_MODES", "numa_mode"]
