"""The ``etcdrun`` command: torchrun's flags with torchrun's meanings, over etcdrun's launcher.

Why torchrun's flags: a job script written for ``torchrun`` runs under ``etcdrun`` by changing
the command name (and ``--rdzv-backend etcd``). Where we differ, it is to fail early and clearly:

- a user's mistake is one line on stderr (``etcdrun: error: ...``) and exit code 2, never a
  traceback; values coming from ``PET_<NAME>`` environment variables are checked as strictly;
- ``--standalone`` uses the static backend on a free local port (torchrun starts a c10d store);
- the script's arguments pass through untouched, a literal ``--`` included (argparse drops it);
- unambiguous prefixes of options work as under torchrun (``--redirect=3``, ``--nnode 2``),
  and ``--nproc`` too (torchrun's argparse calls it ambiguous between ``--nproc-per-node`` and
  its underscore spelling); the script's own arguments are never read as our options.

Why this module imports only argparse, os, sys, agent/flags.py and agent/options.py at the top:
``etcdrun --help`` is a cost paid on every node and measured against torchrun's. The parser
reads the backends' names and traits from the registry (plain data: no backend loads);
LaunchConfig and the launcher (gRPC with etcd) are imported only once the command line is known
to be good. Nothing here names a backend: what a backend takes (an endpoint that is the master
node, a node rank, a required server endpoint) is the registry's to say.

``python -m etcdrun.agent.cli`` runs it too (``python -m etcdrun`` is the short form).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from etcdrun.agent.flags import (
    UsageError,
    check_virtual_local_rank,
    expand_abbreviations,
    find_logs_specs,
    parse_filters,
    parse_nnodes,
    parse_nproc,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_std,
)
from etcdrun.agent.options import DEFAULT_MASTER_PORT, ETCDRUN_ONLY, PROG, build_parser

if TYPE_CHECKING:
    from etcdrun.agent.config import LaunchConfig

__all__ = [
    "UsageError",
    "build_parser",
    "config_from_args",
    "main",
    "parse_args",
    "parse_namespace",
    "run",
]


class _Rendezvous(NamedTuple):
    """The rendezvous part of a LaunchConfig, as the command line decides it."""

    backend: str
    endpoint: str
    run_id: str
    master_addr: str | None = None
    master_port: int | None = None
    node_rank_key: str | None = None


def _script_args(argv: list[str], ns: argparse.Namespace) -> list[str]:
    """The script's arguments exactly as given: argparse drops a ``--`` right after the script."""
    rest = list(ns.script_args)
    k = len(argv) - len(rest) - 1
    if 0 < k < len(argv) and argv[k] == "--" and argv[k - 1] == ns.script:
        return argv[k:]
    return rest


def _rendezvous(ns: argparse.Namespace) -> _Rendezvous:
    """The backend, its endpoint (normalised), the run id and, for a backend whose endpoint is
    the master node, that node's address: all as the launcher should get them.
    """
    from etcdrun.rendezvous import registry

    if ns.standalone:  # the launcher reserves a free port on this machine
        import uuid

        name = registry.STANDALONE_BACKEND
        return _Rendezvous(name, "", str(uuid.uuid4()))
    name = ns.rdzv_backend
    try:
        entry = registry.backend(name)
    except ValueError as exc:
        raise UsageError(f"--rdzv-backend: {exc}") from None
    endpoint = ns.rdzv_endpoint
    if entry.endpoint_example and not endpoint.strip():
        raise UsageError(
            f"--rdzv-endpoint is required with --rdzv-backend {name} "
            f"(e.g. --rdzv-endpoint {entry.endpoint_example})"
        )
    if entry.takes_master and not endpoint:  # like torchrun: an endpoint wins over the flags
        port = DEFAULT_MASTER_PORT if ns.master_port is None else ns.master_port
        endpoint = registry.master_endpoint(name, ns.master_addr, port)
    try:
        read = registry.read_endpoint(name, endpoint)
    except ValueError as exc:
        raise UsageError(f"--rdzv-endpoint: {exc}" if ns.rdzv_endpoint else str(exc)) from None
    return _Rendezvous(
        name, read.endpoint, ns.rdzv_id, read.master_addr, read.master_port, entry.node_rank_key
    )


def _entrypoint(ns: argparse.Namespace, script_args: list[str]) -> tuple[str, list[str], str]:
    """(entrypoint, args, kind): the same command lines as torchrun's; the kind tells the worker
    runtime how to run it, so that it never has to guess.
    """
    if ns.run_path:
        return ns.script, script_args, "run_path"
    if ns.no_python:
        if ns.module:
            raise UsageError("--no-python and --module cannot be used together")
        return ns.script, script_args, "executable"
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    return python, ["-u", *(["-m"] if ns.module else []), ns.script, *script_args], "executable"


def parse_namespace(argv: Sequence[str]) -> argparse.Namespace:
    """The command line as argparse reads it (torch.distributed.run's ``parse_args``): option
    prefixes written out, and ``script_args`` exactly as given (a literal ``--`` kept).
    """
    parser = build_parser()
    argv = expand_abbreviations(parser, list(argv), ETCDRUN_ONLY)
    ns = parser.parse_args(argv)
    ns.script_args = _script_args(argv, ns)
    return ns


def parse_args(argv: Sequence[str]) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str]]:
    """Turn a command line into (LaunchConfig, entrypoint, entrypoint args); runs nothing.

    Raises UsageError (one line) for any mistake, SystemExit(0) for --help and --version.
    """
    return config_from_args(parse_namespace(argv))


def config_from_args(
    ns: argparse.Namespace,
) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str]]:
    """(LaunchConfig, entrypoint, args) from a parsed command line (torch's ``config_from_args``);
    a mistake is a UsageError (a ValueError), as torch raises ValueError.
    """
    script_args = list(ns.script_args)
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    nproc = parse_nproc(ns.nproc_per_node)
    if ns.standalone and max_nodes != 1:
        raise UsageError(f"--standalone runs a single node, but --nnodes is {ns.nnodes!r}")
    rdzv = _rendezvous(ns)
    rdzv_configs: dict[str, Any] = parse_rdzv_conf(ns.rdzv_conf)
    if rdzv.node_rank_key is not None:
        rdzv_configs[rdzv.node_rank_key] = ns.node_rank  # like torchrun: --node-rank wins
    entrypoint, args, kind = _entrypoint(ns, script_args)
    check_virtual_local_rank(ns.virtual_local_rank, nproc)

    from etcdrun.agent.config import LaunchConfig

    try:
        config = LaunchConfig(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nproc_per_node=nproc,
            run_id=rdzv.run_id,
            role=ns.role,
            rdzv_endpoint=rdzv.endpoint,
            rdzv_backend=rdzv.backend,
            rdzv_configs=rdzv_configs,
            max_restarts=ns.max_restarts,
            monitor_interval=ns.monitor_interval,
            start_method=ns.start_method,
            log_dir=ns.log_dir,
            redirects=parse_std("--redirects", ns.redirects),
            tee=parse_std("--tee", ns.tee),
            local_addr=ns.local_addr,
            node_rank=ns.node_rank,
            master_addr=rdzv.master_addr,
            master_port=rdzv.master_port,
            local_ranks_filter=parse_ranks_filter(ns.local_ranks_filter),
            stop_grace=ns.stop_grace,
            prewarm=ns.prewarm,
            restart_grace=ns.restart_grace,
            entrypoint_kind=kind,
            logs_specs=find_logs_specs(ns.logs_specs),
            log_line_prefix_template=ns.log_line_prefix_template
            or os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
            event_log_handler=ns.event_log_handler,
            numa_options=ns.numa_binding,
            signals_to_handle=ns.signals_to_handle,
            on_sigterm=ns.on_sigterm,
            duplicate_stdout_filters=parse_filters(ns.duplicate_stdout_filters),
            duplicate_stderr_filters=parse_filters(ns.duplicate_stderr_filters),
            virtual_local_rank=ns.virtual_local_rank,
            shutdown_timeout=ns.shutdown_timeout,
            hang_timeout=ns.hang_timeout,
            evict_stragglers=ns.evict_stragglers,
            metrics_cfg={} if ns.metrics_port is None else {"port": str(ns.metrics_port)},
        )
    except UsageError:
        raise
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return config, entrypoint, args


def _fail(exc: BaseException, code: int) -> int:
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _setup_logging() -> None:
    """The agent's own lines on stderr, short and prefixed so they stand apart from workers'.
    ``LOGLEVEL`` (torchrun's variable) sets the level; etcdrun.events lines only at DEBUG. The
    etcd client's own lines below WARNING are details (a lease in doubt, lost, or not revoked):
    agent.log keeps them, the console gets the lines a person acts on (etcd unreachable, the
    workers paused or fenced, etcd back), as it does at DEBUG too.
    """
    import logging

    level = os.environ.get("LOGLEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[etcdrun %(asctime)s] %(message)s", "%H:%M:%S"))
    if level != "DEBUG":
        handler.addFilter(_not_client_detail)
    root = logging.getLogger("etcdrun")
    if not root.handlers:
        root.addHandler(handler)
    root.setLevel(level if level in logging._nameToLevel else "INFO")
    logging.getLogger("etcdrun.events").setLevel(
        "DEBUG" if root.level <= logging.DEBUG else "WARNING"
    )


def _not_client_detail(record: Any) -> bool:
    """The console's filter: the etcd client's own lines below WARNING stay off it."""
    return record.levelno >= 30 or not record.name.startswith("etcdrun.rendezvous.client")


def _check_script(config: LaunchConfig, entrypoint: str, args: list[str]) -> None:
    """A script that is not there is one line, before anything starts (torchrun starts every
    worker to find out, and each one prints a traceback). Modules and executables are found by
    the worker, on its own path: they are not checked here.
    """
    if config.entrypoint_kind == "run_path":
        script = entrypoint
    elif entrypoint == os.environ.get("PYTHON_EXEC", sys.executable) and "-m" not in args[:2]:
        script = args[1] if len(args) > 1 else ""
    else:
        return
    if not os.path.isfile(script):
        raise UsageError(f"no such script: {script}")


def run(args: argparse.Namespace | Sequence[str]) -> dict[int, Any]:
    """Run this node's agent for a command line until the job ends, raising as
    ``torch.distributed.run.run`` does: ChildFailedError when the workers failed for good,
    ValueError (UsageError) for a mistake, RendezvousError, SignalException. For programs that
    embed the launcher; the console script (``main``) turns these into exit codes.

    ``args``: a Namespace from ``parse_namespace`` (torch's shape) or the argument list itself.
    Returns ``{global rank: return value}`` of this node's workers (None for scripts).
    """
    ns = args if isinstance(args, argparse.Namespace) else parse_namespace(args)
    return _launch(*_prepare(ns))


def _prepare(ns: argparse.Namespace) -> tuple[LaunchConfig, Any, list[str]]:
    config, entrypoint, cmd_args = config_from_args(ns)
    _check_script(config, entrypoint, cmd_args)
    return config, entrypoint, cmd_args


def _launch(config: LaunchConfig, entrypoint: Any, cmd_args: list[str]) -> dict[int, Any]:
    """The node's standbys first, then the launcher's imports (the rendezvous registry,
    errors, metrics, logs), so that those run beside the standbys' ``import torch``, not before
    it (bench/results/figures.md).
    """
    _setup_logging()
    from etcdrun.agent.standby import pool as standby

    early = standby.early(config.worker_spec(None, entrypoint, cmd_args))
    try:
        from etcdrun.agent.launcher import launch_agent
    except BaseException:
        standby.close(early.pool)
        raise
    return launch_agent(config, entrypoint, cmd_args, early=early)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: parse, then run this node's agent until the job ends; an exit code
    (0 done, 1 workers or rendezvous failed, 2 a mistake, 128+N a signal, 130 Ctrl-C).
    ``etcdrun status ...`` shows a run instead (agent/status_cmd.py), and ``etcdrun drain
    NODE ...`` asks one of its nodes to leave (agent/drain_cmd.py).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["status"]:
        from etcdrun.agent import status_cmd

        return status_cmd.main(argv[1:])
    if argv[:1] == ["drain"]:
        from etcdrun.agent import drain_cmd

        return drain_cmd.main(argv[1:])
    try:
        prepared = _prepare(parse_namespace(argv))
    except UsageError as exc:
        return _fail(exc, 2)
    from etcdrun.rendezvous.errors import RendezvousError

    try:
        _launch(*prepared)
    except ValueError as exc:  # configuration only the backend can judge (e.g. an rdzv-conf key)
        return _fail(exc, 2)
    except RendezvousError as exc:  # etcd unreachable, auth, permission, closed, timeout
        return _fail(exc, 1)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from etcdrun.agent.elastic_agent import SignalException

        if isinstance(exc, SignalException):  # forwarded to the workers; we left the job
            return 128 + int(exc.sigval)
        from etcdrun.agent.errors import ChildFailedError

        if isinstance(exc, ChildFailedError):  # workers failed: their report, not our traceback
            print(exc, file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":  # python -m etcdrun.agent.cli
    sys.exit(main())
