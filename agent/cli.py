"""The ``etcdrun`` command: torchrun's flags with torchrun's meanings, over etcdrun's launcher.

Why torchrun's flags: a job script written for ``torchrun`` runs under ``etcdrun`` by changing
the command name (and ``--rdzv-backend etcd``). Where we differ, it is to fail early and clearly:

- a user's mistake is one line on stderr (``etcdrun: error: ...``) and exit code 2, never a
  traceback; values coming from ``PET_<NAME>`` environment variables are checked as strictly;
- ``--standalone`` uses the static backend on a free local port (torchrun starts a c10d store);
- the script's arguments pass through untouched, a literal ``--`` included (argparse drops it);
- no prefix abbreviations (``--nproc`` is ambiguous between ``--nproc-per-node`` and its
  underscore spelling on Python 3.11; explicit names keep both spellings working).

Why this module imports only argparse, os, sys and agent/flags.py (itself only os) at the top:
``etcdrun --help`` is a cost paid on every node and measured against torchrun's; LaunchConfig,
the registry and the launcher (gRPC) are imported only once the command line is known to be good.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from etcdrun.agent.flags import (
    UsageError,
    parse_nnodes,
    parse_nproc,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_std,
)

if TYPE_CHECKING:
    from etcdrun.agent.config import LaunchConfig

PROG = "etcdrun"
ETCD_BACKENDS = ("etcd", "etcd-v3")
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torchrun's


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print usage + message and exit
        if message.startswith("the following arguments are required: script"):
            message = f"no script to run (usage: {PROG} [options] script [script args...])"
        raise UsageError(message)


class _Formatter(argparse.HelpFormatter):
    """Shows ``--nproc-per-node`` in the help but not its ``--nproc_per_node`` twin."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [s for s in action.option_strings if "_" not in s]
        if action.option_strings and shown != action.option_strings:
            import copy

            action = copy.copy(action)
            action.option_strings = shown
        return super()._format_action_invocation(action)


def _env_name(dest: str) -> str:
    return f"PET_{dest.upper()}"


class _Env(argparse.Action):
    """An option whose default comes from ``PET_<DEST>`` (torchrun's ``env`` action).

    Unlike torchrun, the variable is converted and checked here, so a bad value is reported
    with the variable's name instead of surfacing later as a traceback.
    """

    def __init__(self, option_strings: list[str], dest: str, default: Any = None, **kw: Any):
        name = _env_name(dest)
        raw = os.environ.get(name)
        if raw:
            convert = kw.get("type") or str
            try:
                default = convert(raw)
            except ValueError:
                raise UsageError(f"{name}={raw!r}: invalid {convert.__name__} value") from None
            choices = kw.get("choices")
            if choices is not None and default not in choices:
                raise UsageError(f"{name}={raw!r}: must be one of {', '.join(choices)}")
        super().__init__(option_strings, dest, default=default, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        setattr(namespace, self.dest, values)


class _EnvFlag(argparse.Action):
    """A boolean flag that ``PET_<DEST>=1`` also turns on (torchrun's ``check_env``)."""

    def __init__(self, option_strings: list[str], dest: str, **kw: Any):
        name = _env_name(dest)
        raw = os.environ.get(name, "0").strip() or "0"
        try:
            default = bool(int(raw))
        except ValueError:
            raise UsageError(f"{name}={raw!r}: expected 0 or 1") from None
        super().__init__(option_strings, dest, nargs=0, default=default, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        setattr(namespace, self.dest, True)


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        from etcdrun.rendezvous._version import __version__

        sys.stdout.write(f"{PROG} {__version__}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The parser; built per call because PET_* defaults are read from the environment now."""
    p = _Parser(
        prog=PROG,
        description="Elastic launcher with its rendezvous in etcd v3; torchrun's flags.",
        epilog="Every option can also be set as PET_<OPTION> in the environment "
        "(e.g. PET_NNODES=2:4, PET_NPROC_PER_NODE=2, PET_STANDALONE=1); the command line wins.",
        formatter_class=_Formatter,
        allow_abbrev=False,
    )

    def opt(*names: str, **kw: Any) -> None:
        spellings = [*names]
        for n in names:  # both --dash-case and --underscore_case, like torchrun
            if n.startswith("--") and "-" in n[2:]:
                spellings.append("--" + n[2:].replace("-", "_"))
        p.add_argument(*spellings, **kw)

    opt(
        "--nnodes",
        action=_Env,
        default="1:1",
        metavar="N|MIN:MAX",
        help="number of nodes, or the elastic range MIN:MAX (default: %(default)s)",
    )
    opt(
        "--nproc-per-node",
        action=_Env,
        default="1",
        metavar="N|cpu|gpu|auto",
        help="workers per node; auto: one per GPU, else one per CPU (default: %(default)s)",
    )
    opt(
        "--rdzv-backend",
        action=_Env,
        default="static",
        help="rendezvous backend: static, etcd (alias etcd-v3) (default: %(default)s)",
    )
    opt(
        "--rdzv-endpoint",
        action=_Env,
        default="",
        metavar="ENDPOINTS",
        help="etcd: comma list of [http[s]://]host[:port] (port 2379 when omitted); "
        "static: host:port of the master node",
    )
    opt("--rdzv-id", action=_Env, default="none", help="job id shared by all nodes of a job")
    opt(
        "--rdzv-conf",
        action=_Env,
        default="",
        metavar="K=V,...",
        help="backend options, e.g. lease_ttl=2,join_timeout=60",
    )
    opt(
        "--standalone",
        action=_EnvFlag,
        help="single node, no etcd: static backend on a free local port with a fresh job id "
        "(--rdzv-backend/--rdzv-endpoint/--rdzv-id are ignored)",
    )
    opt(
        "--max-restarts",
        action=_Env,
        type=int,
        default=0,
        help="worker-failure restarts before failing; job-wide with etcd, where a node's death "
        "costs none (default: %(default)s)",
    )
    opt(
        "--monitor-interval",
        action=_Env,
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="how often workers are checked (default: %(default)s)",
    )
    opt(
        "--start-method",
        action=_Env,
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="how callable entrypoints start workers (default: %(default)s)",
    )
    opt("--role", action=_Env, default="default", help="role name of the workers")
    opt("-m", "--module", action=_EnvFlag, help="run the script as a module, like python -m")
    opt("--no-python", action=_EnvFlag, help="run the script as an executable, without python")
    opt(
        "--run-path",
        action=_EnvFlag,
        help="run the script with runpy.run_path in a fresh interpreter per worker "
        "(takes precedence over --no-python)",
    )
    opt("--log-dir", action=_Env, default=None, help="base directory for logs")
    opt(
        "-r",
        "--redirects",
        action=_Env,
        default="0",
        metavar="0-3|RANK:0-3,...",
        help="redirect worker stdout (1), stderr (2) or both (3) to log files, for all local "
        "ranks or per local rank (e.g. 0:1,1:2)",
    )
    opt(
        "-t",
        "--tee",
        action=_Env,
        default="0",
        metavar="0-3|RANK:0-3,...",
        help="like --redirects, but also keep the output on the console",
    )
    opt(
        "--local-ranks-filter",
        action=_Env,
        default="",
        metavar="RANK,...",
        help="show only these local ranks' output on the console",
    )
    opt(
        "--node-rank",
        action=_Env,
        type=int,
        default=0,
        help="this node's rank (static backend) (default: %(default)s)",
    )
    opt(
        "--master-addr",
        action=_Env,
        default=None,
        help=f"master node address, static backend only (default: {DEFAULT_MASTER_ADDR})",
    )
    opt(
        "--master-port",
        action=_Env,
        type=int,
        default=None,
        help=f"master node port, static backend only (default: {DEFAULT_MASTER_PORT})",
    )
    opt(
        "--local-addr",
        action=_Env,
        default=None,
        help="this node's address as peers should reach it",
    )
    opt(
        "--stop-grace",
        action=_Env,
        type=float,
        default=None,
        metavar="SECONDS",
        help="grace between SIGTERM and SIGKILL when stopping workers (default: 30)",
    )
    p.add_argument("--version", action=_Version, help="print the version and exit")
    p.add_argument(
        "script",
        help="the training script (or module with -m, executable with "
        "--no-python), followed by its own arguments",
    )
    p.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def _script_args(argv: list[str], ns: argparse.Namespace) -> list[str]:
    """The script's arguments exactly as given: argparse drops a ``--`` right after the script."""
    rest = list(ns.script_args)
    k = len(argv) - len(rest) - 1
    if 0 < k < len(argv) and argv[k] == "--" and argv[k - 1] == ns.script:
        return argv[k:]
    return rest


def _rendezvous(ns: argparse.Namespace) -> tuple[str, str, str, str | None, int | None]:
    """(backend, endpoint, run_id, master_addr, master_port) as the launcher should get them."""
    from etcdrun.rendezvous.registry import check_backend

    if ns.standalone:  # the launcher reserves a free port on 127.0.0.1
        import uuid

        return "static", "", str(uuid.uuid4()), None, None
    backend = ns.rdzv_backend
    try:
        check_backend(backend)
    except ValueError as exc:
        raise UsageError(f"--rdzv-backend: {exc}") from None
    if backend == "static":
        from etcdrun.rendezvous.static import format_endpoint, parse_static_endpoint

        endpoint = ns.rdzv_endpoint or format_endpoint(
            ns.master_addr or DEFAULT_MASTER_ADDR,
            DEFAULT_MASTER_PORT if ns.master_port is None else ns.master_port,
        )
        try:
            host, port = parse_static_endpoint(endpoint)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return backend, endpoint, ns.rdzv_id, host, port
    if backend in ETCD_BACKENDS:
        from etcdrun.rendezvous.client.config import parse_endpoints

        if not ns.rdzv_endpoint.strip():
            raise UsageError(
                f"--rdzv-endpoint is required with --rdzv-backend {backend} "
                "(e.g. --rdzv-endpoint localhost:2379)"
            )
        try:
            endpoints = parse_endpoints(ns.rdzv_endpoint)
        except ValueError as exc:
            raise UsageError(f"--rdzv-endpoint: {exc}") from None
        return backend, ",".join(str(e) for e in endpoints), ns.rdzv_id, None, None
    return backend, ns.rdzv_endpoint, ns.rdzv_id, None, None


def parse_args(argv: Sequence[str]) -> tuple[LaunchConfig, Callable[..., Any] | str, list[str]]:
    """Turn a command line into (LaunchConfig, entrypoint, entrypoint args); runs nothing.

    Raises UsageError (one line) for any mistake, SystemExit(0) for --help and --version.
    """
    argv = list(argv)
    ns = build_parser().parse_args(argv)
    script_args = _script_args(argv, ns)
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    nproc = parse_nproc(ns.nproc_per_node)
    if ns.standalone and max_nodes != 1:
        raise UsageError(f"--standalone runs a single node, but --nnodes is {ns.nnodes!r}")
    backend, endpoint, run_id, master_addr, master_port = _rendezvous(ns)
    rdzv_configs: dict[str, Any] = parse_rdzv_conf(ns.rdzv_conf)
    if backend == "static":
        rdzv_configs["rank"] = ns.node_rank  # like torchrun: --node-rank wins over rank=

    # The same command lines as torchrun's; the kind tells the worker runtime not to guess.
    entrypoint: str = ns.script
    args = script_args
    if ns.run_path:
        kind = "run_path"
    elif ns.no_python:
        if ns.module:
            raise UsageError("--no-python and --module cannot be used together")
        kind = "executable"
    else:
        kind = "executable"
        entrypoint = os.environ.get("PYTHON_EXEC", sys.executable)
        args = ["-u", *(["-m"] if ns.module else []), ns.script, *script_args]

    from etcdrun.agent.config import LaunchConfig

    try:
        config = LaunchConfig(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nproc_per_node=nproc,
            run_id=run_id,
            role=ns.role,
            rdzv_endpoint=endpoint,
            rdzv_backend=backend,
            rdzv_configs=rdzv_configs,
            max_restarts=ns.max_restarts,
            monitor_interval=ns.monitor_interval,
            start_method=ns.start_method,
            log_dir=ns.log_dir,
            redirects=parse_std("--redirects", ns.redirects),
            tee=parse_std("--tee", ns.tee),
            local_addr=ns.local_addr,
            node_rank=ns.node_rank,
            master_addr=master_addr,
            master_port=master_port,
            local_ranks_filter=parse_ranks_filter(ns.local_ranks_filter),
            stop_grace=ns.stop_grace,
            entrypoint_kind=kind,
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
    ``LOGLEVEL`` (torchrun's variable) sets the level; etcdrun.events lines only at DEBUG."""
    import logging

    level = os.environ.get("LOGLEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[etcdrun %(asctime)s] %(message)s", "%H:%M:%S"))
    root = logging.getLogger("etcdrun")
    if not root.handlers:
        root.addHandler(handler)
    root.setLevel(level if level in logging._nameToLevel else "INFO")
    logging.getLogger("etcdrun.events").setLevel(
        "DEBUG" if root.level <= logging.DEBUG else "WARNING"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: parse, then run this node's agent until the job ends."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        config, entrypoint, args = parse_args(argv)
    except UsageError as exc:
        return _fail(exc, 2)

    _setup_logging()
    from etcdrun.agent.launcher import launch_agent
    from etcdrun.rendezvous.errors import RendezvousError

    try:
        launch_agent(config, entrypoint, args)
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
