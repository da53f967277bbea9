"""The ``etcdrun`` parser: torchrun's options, their ``PET_*`` defaults, and their help.

Why apart from cli.py: this is the declaration (every option, its spelling and its help text);
cli.py is the flow (parse, resolve the rendezvous, build the LaunchConfig, run). What the help
says about backends (their names, what their endpoint is, which take a node rank or a master
address) is read from the registry, never typed here: the registry is plain data (no backend is
loaded), so ``etcdrun --help`` stays cheap: it imports no gRPC (bench/results/figures.md).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

from etcdrun.agent.flags import DEFAULT_PREWARM, UsageError

__all__ = ["DEFAULT_MASTER_PORT", "ETCDRUN_ONLY", "PROG", "build_parser"]

PROG = "etcdrun"
DEFAULT_MASTER_PORT = 29500  # torchrun's
# Our options that torchrun does not have; every other option string is torchrun's (a test
# compares the two parsers). An abbreviation means what it means under torchrun.
ETCDRUN_ONLY = frozenset(
    {"--stop-grace", "--stop_grace", "--restart-grace", "--restart_grace", "--metrics-port"}
    | {"--metrics_port", "--prewarm", "--version", "--hang-timeout", "--hang_timeout"}
    | {"--on-sigterm", "--on_sigterm", "--evict-stragglers", "--evict_stragglers"}
)


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


class _Completion(argparse.Action):
    """torchrun's ``--print-completion``: a shell completion script made by the optional
    ``shtab`` package from this parser, so it cannot drift from the options. Without shtab,
    torchrun's own line and exit status: it is not a dependency of either launcher.
    """

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        try:
            import shtab  # type: ignore[import-not-found]
        except ImportError:
            parser.exit(
                1, f"{PROG}: {option_string} requires the 'shtab' package: pip install shtab\n"
            )
        sys.stdout.write(shtab.complete(parser, shell=values) + "\n")
        parser.exit()


class _Version(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None):
        from etcdrun.rendezvous._version import __version__

        sys.stdout.write(f"{PROG} {__version__}\n")
        parser.exit()


def _opt(p: argparse.ArgumentParser, *names: str, **kw: Any) -> None:
    """Both --dash-case and --underscore_case, like torchrun."""
    spellings = [*names]
    for n in names:
        if n.startswith("--") and "-" in n[2:]:
            spellings.append("--" + n[2:].replace("-", "_"))
    p.add_argument(*spellings, **kw)


def _backends_that(pred: Any) -> str:
    from etcdrun.rendezvous.registry import backend_groups

    return ", ".join(name for name, _, entry in backend_groups() if pred(entry)) or "none"


def _add_size_options(p: argparse.ArgumentParser) -> None:
    _opt(
        p,
        "--nnodes",
        action=_Env,
        default="1:1",
        metavar="N|MIN:MAX",
        help="number of nodes, or the elastic range MIN:MAX (default: %(default)s)",
    )
    _opt(
        p,
        "--nproc-per-node",
        action=_Env,
        default="1",
        metavar="N|cpu|gpu|xpu|auto",
        help="workers per node: a number, or one per CPU, GPU (NVIDIA, or AMD under ROCm) or "
        "Intel XPU; auto: GPUs, else XPUs, else CPUs (default: %(default)s)",
    )


def _add_rdzv_options(p: argparse.ArgumentParser) -> None:
    from etcdrun.rendezvous import registry

    endpoints = "; ".join(
        f"{name}: {entry.endpoint_help}"
        for name, _, entry in registry.backend_groups()
        if entry.endpoint_help
    )
    _opt(
        p,
        "--rdzv-backend",
        action=_Env,
        default=registry.DEFAULT_BACKEND,
        help=f"rendezvous backend: {registry.describe_backends()} (default: %(default)s)",
    )
    _opt(p, "--rdzv-endpoint", action=_Env, default="", metavar="ENDPOINTS", help=endpoints)
    _opt(p, "--rdzv-id", action=_Env, default="none", help="job id shared by all nodes of a job")
    _opt(
        p,
        "--rdzv-conf",
        action=_Env,
        default="",
        metavar="K=V,...",
        help="backend options, e.g. lease_ttl=2,join_timeout=60",
    )
    _opt(
        p,
        "--standalone",
        action=_EnvFlag,
        help=f"single node, no server: the {registry.STANDALONE_BACKEND} backend on a free local "
        "port with a fresh job id (--rdzv-backend/--rdzv-endpoint/--rdzv-id are ignored)",
    )


def _add_run_options(p: argparse.ArgumentParser) -> None:
    _opt(
        p,
        "--max-restarts",
        action=_Env,
        type=int,
        default=0,
        help="worker-failure restarts before failing; job-wide with etcd, where a node's death "
        "costs none (default: %(default)s)",
    )
    _opt(
        p,
        "--monitor-interval",
        action=_Env,
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="how often a worker the kernel gives no exit notice for (no pidfd) is polled; "
        "exits, membership changes and signals wake the agent at once, so it never polls "
        "them (0: every 10 ms) (default: %(default)s)",
    )


def _add_entrypoint_options(p: argparse.ArgumentParser) -> None:
    _opt(
        p,
        "--start-method",
        action=_Env,
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="how callable entrypoints start workers (default: %(default)s)",
    )
    _opt(p, "--role", action=_Env, default="default", help="role name of the workers")
    _opt(p, "-m", "--module", action=_EnvFlag, help="run the script as a module, like python -m")
    _opt(p, "--no-python", action=_EnvFlag, help="run the script as an executable, without python")
    _opt(
        p,
        "--run-path",
        action=_EnvFlag,
        help="run the script with runpy.run_path in a fresh interpreter per worker "
        "(takes precedence over --no-python)",
    )
    _opt(
        p,
        "--prewarm",
        action=_Env,
        default=DEFAULT_PREWARM,
        metavar="none|auto|MODULE,...",
        help="standby workers: one warm Python per slot, started ahead of the round, with these "
        "modules imported (auto: torch if installed; none: spawn each round) (default: "
        "%(default)s)",
    )


def _add_output_options(p: argparse.ArgumentParser) -> None:
    _opt(p, "--log-dir", action=_Env, default=None, help="base directory for logs")
    _opt(
        p,
        "-r",
        "--redirects",
        action=_Env,
        default="0",
        metavar="0-3|RANK:0-3,...",
        help="redirect worker stdout (1), stderr (2) or both (3) to log files, for all local "
        "ranks or per local rank (e.g. 0:1,1:2)",
    )
    _opt(
        p,
        "-t",
        "--tee",
        action=_Env,
        default="0",
        metavar="0-3|RANK:0-3,...",
        help="like --redirects, but also keep the output on the console",
    )
    _opt(
        p,
        "--log-line-prefix-template",
        action=_Env,
        default=None,
        metavar="TEMPLATE",
        help="prefix of each worker console line, with ${role_name}, ${rank}, ${local_rank}, "
        "${hostname} (e.g. '${hostname}:${rank}: '); default: [${role_name}${local_rank}]: on "
        "teed lines, as torchrun (also TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)",
    )
    _opt(
        p,
        "--event-log-handler",
        action=_Env,
        default="null",
        choices=["null", "console", "dynamic_rendezvous"],
        help="events (one JSON line per transition) go to <log dir>/events.jsonl; console: "
        "also on stderr (default: %(default)s)",
    )
    _opt(
        p,
        "--metrics-port",
        action=_Env,
        type=int,
        default=None,
        metavar="PORT",
        help="serve /healthz, /livez and, with prometheus-client installed, /metrics on PORT",
    )
    _opt(
        p,
        "--local-ranks-filter",
        action=_Env,
        default="",
        metavar="RANK,...",
        help="show only these local ranks' output on the console",
    )
    for std in ("stdout", "stderr"):
        _opt(
            p,
            f"--duplicate-{std}-filters",
            action=_Env,
            default=None,
            metavar="TEXT,...",
            help=f"teed {std} lines holding any of these strings also go to "
            f"<log_dir>/<run_id>/attempt_<n>/filtered_{std}.log (',,' is a comma)",
        )


def _add_node_options(p: argparse.ArgumentParser) -> None:
    from etcdrun.rendezvous.registry import DEFAULT_MASTER_ADDR

    ranked = _backends_that(lambda b: b.node_rank_key is not None)
    mastered = _backends_that(lambda b: b.takes_master)
    _opt(
        p,
        "--node-rank",
        action=_Env,
        type=int,
        default=0,
        help=f"this node's rank ({ranked} backend) (default: %(default)s)",
    )
    _opt(
        p,
        "--master-addr",
        action=_Env,
        default=None,
        help=f"master node address, {mastered} backend only (default: {DEFAULT_MASTER_ADDR})",
    )
    _opt(
        p,
        "--master-port",
        action=_Env,
        type=int,
        default=None,
        help=f"master node port, {mastered} backend only (default: {DEFAULT_MASTER_PORT})",
    )
    _opt(
        p,
        "--local-addr",
        action=_Env,
        default=None,
        help="this node's address as peers should reach it",
    )


def _add_torch_213_options(p: argparse.ArgumentParser) -> None:
    """torchrun 2.13's and 2.14's newer options, with its meanings (and where they are not
    honoured here, one line at start says so: LaunchConfig.notices).
    """
    _opt(
        p,
        "--print-completion",
        action=_Completion,
        choices=["bash", "zsh", "tcsh"],
        help="print a shell completion script for etcdrun and exit (needs the optional "
        "'shtab' package, as under torchrun)",
    )
    _opt(
        p,
        "--logs-specs",
        default=None,
        metavar="NAME",
        help="a torchrun.logs_specs entry point; accepted, not used (said at start)",
    )
    _opt(
        p,
        "--numa-binding",
        default=None,
        choices=["node", "socket", "exclusive", "core-complex"],
        help="torchrun's CPU binding near each worker's GPU; accepted, not honoured "
        "(said at start)",
    )
    _opt(
        p,
        "--signals-to-handle",
        action=_Env,
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        metavar="SIG,...",
        help="signals the agent passes on to the workers (then SIGKILL after the grace) before it "
        "leaves; e.g. add SIGUSR1 for Slurm's --signal (default: %(default)s)",
    )
    _opt(
        p,
        "--on-sigterm",
        action=_Env,
        default="drain",
        choices=["drain", "stop"],
        help="what SIGTERM to the agent means while the job has more than its min nodes: drain "
        "(this node leaves gracefully, exit 0, no restart charged; the others go on) or stop "
        "(torchrun's: forward it, exit 143). At min nodes it always stops (default: "
        "%(default)s)",
    )
    for name, say in (
        (
            "--shutdown-timeout",
            "grace between the stop signal and SIGKILL when stopping workers "
            "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
        ),
        ("--stop-grace", "etcdrun's name of --shutdown-timeout (one setting: give either)"),
        (
            "--restart-grace",
            "grace between SIGTERM and SIGKILL when workers stop between rounds "
            "(a membership change, a restart after a failure): their world is broken, a worker "
            "blocked in a collective never ends by itself (default: 3; the job's end keeps the "
            "--shutdown-timeout)",
        ),
    ):
        _opt(p, name, action=_Env, type=float, default=None, metavar="SECONDS", help=say)
    _opt(
        p,
        "--hang-timeout",
        action=_Env,
        type=float,
        default=None,
        metavar="SECONDS",
        help="end a round whose worker reported no progress (etcdrun.elastic's commit() or "
        "progress()) for this long, with every worker's stack and the stuck frame on every node "
        "(default: off; docs/hangs.md)",
    )
    _opt(
        p,
        "--evict-stragglers",
        action=_EnvFlag,
        help="the rendezvous leader asks a straggler (a node whose steps per CPU-second fall "
        "below straggler_fraction of the median) to leave at the next round, as etcdrun drain "
        "does, while the job keeps its min nodes; a spare takes its place (default: off: "
        "stragglers are only named; docs/hangs.md)",
    )
    _opt(
        p,
        "--virtual-local-rank",
        action=_EnvFlag,
        help="every worker gets LOCAL_RANK 0 and CUDA_VISIBLE_DEVICES naming its one GPU",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser; built per call because PET_* defaults are read from the environment now."""
    p = _Parser(
        prog=PROG,
        description="Elastic launcher with its rendezvous in etcd v3; torchrun's flags. "
        "Two more commands act on a running job: `etcdrun status` shows its rounds and nodes "
        "(docs/operating.md), `etcdrun drain NODE` asks one node to leave (docs/drain.md); "
        "each takes --help.",
        epilog="Every option can also be set as PET_<OPTION> in the environment "
        "(e.g. PET_NNODES=2:4, PET_NPROC_PER_NODE=2, PET_STANDALONE=1); the command line wins.",
        formatter_class=_Formatter,
        allow_abbrev=False,
    )
    for add in (
        _add_size_options,
        _add_rdzv_options,
        _add_run_options,
        _add_entrypoint_options,
        _add_output_options,
        _add_node_options,
        _add_torch_213_options,
    ):
        add(p)
    p.add_argument("--version", action=_Version, help="print the version and exit")
    p.add_argument(
        "script",
        help="the training script (or module with -m, executable with "
        "--no-python), followed by its own arguments",
    )
    p.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p
