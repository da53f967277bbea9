"""``LaunchConfig``: everything one node needs to run an elastic job.

Why a plain dataclass with the reference launcher's fields, defaults and ValueError messages: code
written against torch.distributed.launcher's ``LaunchConfig`` ports by changing one import, and the
CLI, the Python API and the tests all validate through this one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from etcdrun.rendezvous.api import check_node_range, check_run_id


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
    ``event_log_handler`` (null or console: events.jsonl always, the console too) are the
    reference's fields, given a meaning here (agent/metrics.py, agent/event_sink.py).

    ``local_ranks_filter``, ``stop_grace`` and ``entrypoint_kind`` are ours, not the
    reference's; their defaults change nothing:
    ``local_ranks_filter`` (only these local ranks' output reaches the console; None: all),
    ``stop_grace`` (seconds between SIGTERM and SIGKILL when stopping workers; None: the agent's
    default, 30 s like torchrun) and ``entrypoint_kind`` (how a string entrypoint runs: "auto"
    guesses like torch; the CLI says exactly, e.g. "executable" for ``--no-python``; see
    ``etcdrun.agent.api.EntrypointKind``).
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
    # torch's name and default: "null" (events.jsonl only) or "console" (also on stderr).
    event_log_handler: str = "null"

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
        if self.local_ranks_filter is not None and any(r < 0 for r in self.local_ranks_filter):
            raise ValueError(
                f"local_ranks_filter ({sorted(self.local_ranks_filter)}) must hold "
                "non-negative local ranks"
            )


__all__ = ["LaunchConfig"]
