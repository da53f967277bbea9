"""``elastic_launch`` and ``launch_agent``: the Python API behind the ``etcdrun`` command.

Why the reference launcher's shape (``elastic_launch(config, entrypoint)(*args)``,
``launch_agent(config, entrypoint, args)``): code that launches jobs through
torch.distributed.launcher switches to etcdrun by changing its imports.

Why the agent is imported inside ``launch_agent``: it pulls in the worker runtime and, with the
etcd backend, gRPC; building a config or a handler must stay cheap.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from etcdrun.agent.api import entrypoint_name
from etcdrun.agent.config import LaunchConfig
from etcdrun.agent.errors import ChildFailedError, record
from etcdrun.agent.report.event_sink import check_handler
from etcdrun.agent.report.metrics import INSTALL, MetricsConfig, prometheus_available
from etcdrun.agent.standby import pool as standby
from etcdrun.agent.worker.logdir import NOTICES, AgentLogFile, LogDirError, check_writable, describe
from etcdrun.rendezvous import registry
from etcdrun.rendezvous.api import RendezvousHandler, RendezvousParameters, ReportPort
from etcdrun.rendezvous.free_port import reserve_free_port

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]

logger = logging.getLogger(__name__)


class _NodeField(logging.Filter):
    """Puts the node id on every record of agent.log: several agents sharing one --log-dir
    append to one file, and each line must say which node wrote it. Before the first session
    (and for the static backend) the node is ``<host>:<pid>``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.report: ReportPort | None = None
        self._fallback = f"{socket.gethostname()}:{os.getpid()}"

    def filter(self, record: logging.LogRecord) -> bool:
        node = self.report.node_id() if self.report is not None else None
        record.node = node or self._fallback
        return True


def _setup_logs(config: LaunchConfig) -> logging.Handler | None:
    """With ``log_dir``, the agent's own log also goes to ``<log_dir>/agent.log``, each line
    naming its node.

    The handler is returned so that ``launch_agent`` removes it again: several launches in one
    process (tests, notebooks) must not stack handlers or leak open files.
    """
    NOTICES.reset()
    if not config.log_dir:
        return None
    check_writable(config.log_dir)  # read-only: one line now, before the rendezvous is joined
    path = os.path.join(config.log_dir, "agent.log")
    try:
        handler = AgentLogFile(path)
    except OSError as e:
        raise LogDirError(f"--log-dir: {describe(path, e)}: cannot write there") from None
    node = _NodeField()
    handler.addFilter(node)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(node)s %(name)s %(levelname)s %(message)s")
    )
    logging.getLogger("etcdrun").addHandler(handler)
    return handler


def _name_nodes(log_handler: logging.Handler | None, rdzv: RendezvousHandler) -> None:
    """From now on agent.log names the rendezvous' node (its id changes per incarnation)."""
    for f in log_handler.filters if log_handler is not None else ():
        if isinstance(f, _NodeField):
            f.report = rdzv.report()


def _metrics_config(config: LaunchConfig) -> MetricsConfig:
    """The metrics and events settings, checked: a handler that cannot work is refused now."""
    check_handler(config.event_log_handler)
    metrics = MetricsConfig.from_cfg(config.metrics_cfg)
    if metrics.handler == "prometheus" and not metrics.implicit and not prometheus_available():
        raise ValueError(f"the prometheus metrics handler needs prometheus-client: {INSTALL}")
    return metrics


def _one_value(conf: dict[str, Any], key: str, value: Any, *, flag: str, always: bool) -> None:
    """One rule for a setting that is both a flag (a LaunchConfig field) and an ``--rdzv-conf``
    key: a flag left at its default (off, 0) yields to the key; a flag set otherwise and the
    key must say the same, else one line naming both. Before, ``max_restarts`` raised and
    ``evict_stragglers`` silently lost to the key. ``always``: the key is passed even at the
    default (the budget's one value feeds TORCHELASTIC_MAX_RESTARTS and the log lines).
    """
    if key not in conf:
        if value or always:
            conf[key] = value
        return
    if value and _conf_text(conf[key]) != _conf_text(value):
        raise ValueError(
            f"{key} is given twice with different values: {flag} and --rdzv-conf {key}={conf[key]}"
        )


def _conf_text(value: Any) -> str:
    """A key's value as compared: true/yes/on are 1, false/no/off are 0 (the backend's words)."""
    text = str(value).strip().lower()
    return {"true": "1", "yes": "1", "on": "1", "false": "0", "no": "0", "off": "0"}.get(text, text)


def _make_rdzv_handler(config: LaunchConfig) -> RendezvousHandler:
    """The rendezvous handler for ``config`` (the reference's rules, plus min/max as fields)."""
    entry = registry.backend(config.rdzv_backend)
    endpoint = config.rdzv_endpoint
    if entry.takes_master and not endpoint:  # the Python API's way: a free port, not 29500
        port = config.master_port if config.master_port is not None else reserve_free_port()
        endpoint = registry.master_endpoint(config.rdzv_backend, config.master_addr, port)
    run_id = registry.pick_run_id(config.rdzv_backend, config.run_id, config.max_nodes)
    if run_id != config.run_id:  # torch's launcher too gives an id when none is given
        logger.warning("no run id given (--rdzv-id): this one-node job runs as %s", run_id)
        config.run_id = run_id
    rdzv_configs = dict(config.rdzv_configs)
    if config.rdzv_timeout > 0:
        rdzv_configs.setdefault("join_timeout", config.rdzv_timeout)
    if entry.node_rank_key is not None:
        rdzv_configs.setdefault(entry.node_rank_key, config.node_rank)
    # The rendezvous owns the restart budget (every backend): one value feeds its decisions,
    # TORCHELASTIC_MAX_RESTARTS and the log lines. The leader decides evictions
    # (rendezvous/etcd/leader/stragglers.py).
    n = config.max_restarts
    _one_value(rdzv_configs, "max_restarts", n, flag=f"--max-restarts {n}", always=True)
    evict = "1" if config.evict_stragglers else ""
    _one_value(rdzv_configs, "evict_stragglers", evict, flag="--evict-stragglers", always=False)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        node_rank=config.node_rank,
        local_world_size=config.nproc_per_node,
        config=rdzv_configs,
    )
    return registry.create_handler(params)


def _shutdown_quietly(handler: RendezvousHandler) -> None:
    # Never let a failing shutdown replace the exception (or result) that matters.
    try:
        handler.shutdown()
    except Exception:
        logger.warning("rendezvous shutdown failed (run %s)", handler.get_run_id(), exc_info=True)


@record  # a nested launch (the agent itself run as a worker) reports its root cause upward
def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    args: list[Any],
    *,
    early: standby.Early | None = None,
) -> dict[int, Any]:
    """Run this node's agent for ``entrypoint`` until the job ends.

    ``early``: this node's standbys, when the caller already started them (the CLI does, before
    this module's imports: agent/cli.py ``_launch``); they are closed here on every way out.

    Returns ``{global_rank: return value}`` for this node's workers (values are None unless the
    entrypoint is a callable). Raises ``ChildFailedError`` when workers failed and the restart
    budget is spent; the rendezvous is left (lease revoked) on every way out.
    """
    log_handler: logging.Handler | None = None
    rdzv_handler: RendezvousHandler | None = None
    try:  # the caller's standbys too are closed below when a setting is refused
        metrics = _metrics_config(config)  # a bad value is one line before anything starts
        log_handler = _setup_logs(config)
        if early is None:
            early = standby.early(config.worker_spec(None, entrypoint, args))  # before gRPC
        rdzv_handler = _make_rdzv_handler(config)
        _name_nodes(log_handler, rdzv_handler)
        spec = config.worker_spec(rdzv_handler, entrypoint, args)
        from etcdrun.agent.elastic_agent import ElasticAgent

        nodes = (
            f"{config.min_nodes}"
            if config.min_nodes == config.max_nodes
            else f"{config.min_nodes}..{config.max_nodes}"
        )
        logger.info(
            "starting %s: run %s, %s node%s x %d worker%s, backend %s",
            entrypoint_name(entrypoint, args),
            config.run_id,
            nodes,
            "" if config.max_nodes == 1 else "s",
            config.nproc_per_node,
            "" if config.nproc_per_node == 1 else "s",
            config.rdzv_backend,
        )
        for line in config.notices():  # torchrun's settings not honoured here, one line each
            logger.warning("%s", line)
        agent = ElasticAgent(
            spec, event_log_handler=config.event_log_handler, metrics=metrics, early=early
        )
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=entrypoint_name(entrypoint, args), failures=result.failures)
        return result.return_values
    finally:
        if early is not None:
            standby.close(early.pool)  # the agent closed them, unless it never started
        if rdzv_handler is not None:
            _shutdown_quietly(rdzv_handler)
        if log_handler is not None:
            logging.getLogger("etcdrun").removeHandler(log_handler)
            log_handler.close()


class elastic_launch:
    """``elastic_launch(config, entrypoint)(*args)``: launch_agent as a callable.

    Usage::

        elastic_launch(LaunchConfig(nproc_per_node=2), "train.py")("--epochs", "10")
    """

    def __init__(self, config: LaunchConfig, entrypoint: Callable[..., Any] | str | None) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))
