"""rendezvous_scale.py's options, apart from the runner: they grew with each diagnosis (clients
per stream, pinning, etcd's log and profiles), and one bad value must give one line, never a
traceback halfway through a four-minute run.
"""

from __future__ import annotations

import argparse
import os
import sys


def cpu_list(text: str) -> list[int]:
    """``0`` or ``0,1``: CPUs this machine has."""
    cpus = [int(x) for x in text.split(",") if x.strip()]
    if not cpus or not set(cpus) <= os.sched_getaffinity(0):
        raise argparse.ArgumentTypeError(f"{text!r}: not CPUs of {sorted(os.sched_getaffinity(0))}")
    return cpus


def _round_options(ap: argparse.ArgumentParser) -> None:
    """Who takes part and how the rounds run."""
    ap.add_argument("--n", default="10,100,1000", help="comma-separated participant counts")
    ap.add_argument("--members", default="1", help="comma-separated etcd cluster sizes (default 1)")
    ap.add_argument("--procs", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument(
        "--per-client",
        type=int,
        default=0,
        metavar="K",
        help="handlers per etcd client, i.e. per gRPC channel and watch stream (default 0: one "
        "client per process)",
    )
    ap.add_argument(
        "--keepalive",
        choices=("relay", "in-process"),
        default="relay",
        help="who sends the simulated nodes' keep-alives: a relay process per worker (default), "
        "or each worker's clients themselves, as a real agent does",
    )
    ap.add_argument(
        "--leave",
        choices=("member", "leader"),
        default="member",
        help="who leaves for round 2 (default: a non-leader member)",
    )
    ap.add_argument(
        "--arrive-over",
        type=float,
        default=0.0,
        metavar="S",
        help="round 1: spread the participants' arrivals evenly over S seconds (default 0: all "
        "at once)",
    )
    ap.add_argument("--lease-ttl", type=int, default=5, help="rdzv lease_ttl (default 5)")
    ap.add_argument(
        "--shard-at",
        type=int,
        default=None,
        metavar="K",
        help="rdzv shard_at: a frozen round of K participants or more goes to shard keys "
        "(default: the backend's, which is 0: never)",
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="per-round bound, seconds")
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="before each N, wait up to this long for a quiet machine (default 120 s)",
    )


def _machine_options(ap: argparse.ArgumentParser) -> None:
    """Where etcd and the handlers run, and what is kept for a diagnosis."""
    ap.add_argument(
        "--etcd-cpus",
        type=cpu_list,
        default=[],
        metavar="LIST",
        help="pin every etcd member to these CPUs, e.g. 0 (default: not pinned)",
    )
    ap.add_argument(
        "--worker-cpus",
        type=cpu_list,
        default=[],
        metavar="LIST",
        help="pin the processes hosting the handlers to these CPUs, e.g. 1 (default: not pinned)",
    )
    ap.add_argument(
        "--grpc-proxy",
        action="store_true",
        help="put an `etcd grpc-proxy` (it coalesces identical watches) between the simulated "
        "nodes and the members",
    )
    ap.add_argument("--etcd-log", metavar="DIR", help="keep each etcd member's log in DIR")
    ap.add_argument(
        "--etcd-pprof",
        action="store_true",
        help="start etcd with --enable-pprof (Go profiles at <endpoint>/debug/pprof/)",
    )
    ap.add_argument("--py-spy", metavar="DIR", help="record every worker with py-spy (raw stacks)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--svg", help="also plot round time vs N (log-log, with the fits) here")
    ap.add_argument("--check", action="store_true", help="exit 1 on a miss")


def parse(
    argv: list[str] | None, description: str = ""
) -> tuple[argparse.Namespace, list[int], list[int]] | None:
    """The options, the N and the cluster sizes to run; None (after one line on stderr) when
    they are bad.
    """
    ap = argparse.ArgumentParser(description=description)
    _round_options(ap)
    _machine_options(ap)
    args = ap.parse_args(argv)
    try:
        ns = [int(x) for x in args.n.split(",") if x.strip()]
        ms = [int(x) for x in args.members.split(",") if x.strip()]
    except ValueError:
        ns = ms = []
    bad_counts = not ns or min(ns) < 1 or not ms or min(ms) < 1
    bad_numbers = (
        args.procs < 1
        or args.per_client < 0
        or args.lease_ttl < 1
        or args.timeout <= 0
        or args.arrive_over < 0
        or (args.shard_at is not None and (args.shard_at < 0 or args.shard_at == 1))
    )
    if args.grpc_proxy and args.keepalive != "relay":
        print("--grpc-proxy needs --keepalive relay (scale_proxy.py says why)", file=sys.stderr)
        return None
    if bad_counts or bad_numbers:
        print(
            f"bad arguments: --n {args.n!r} and --members {args.members!r} must list integers "
            f">= 1; --procs, --lease-ttl and --timeout must be positive, --arrive-over and "
            "--per-client >= 0, --shard-at 0 or >= 2",
            file=sys.stderr,
        )
        return None
    return args, ns, ms
