"""``etcdrun drain NODE``: ask one node of a running job to leave gracefully (docs/drain.md).

Why a subcommand with ``etcdrun status``'s flags: the operator who sees a bad or doomed node in
``etcdrun status`` drains it with the same endpoint, run id, TLS and auth (agent/run_flags.py).
The node hears of it through a watch; this command only writes the request
(rendezvous/etcd/core/drain_request.py) and returns: the node's own last line says when it is gone.
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
from collections.abc import Sequence

from etcdrun.agent.flags import UsageError
from etcdrun.agent.run_flags import OneLineParser, add_run_flags, keys_and_client


def _parser() -> OneLineParser:
    p = OneLineParser(
        prog="etcdrun drain",
        description=(
            "Ask one node of a running job to leave gracefully: its workers stop, it leaves "
            "the job, no restart is charged and the others go on in a new round."
        ),
        allow_abbrev=False,
    )
    p.add_argument("node", help="the node's id as `etcdrun status` shows it (or a unique prefix)")
    add_run_flags(p)
    p.add_argument(
        "--force",
        action="store_true",
        help="drain it even when the job then has fewer than its min nodes (it waits for one)",
    )
    return p


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"etcdrun drain ({user}@{socket.gethostname()}, pid {os.getpid()})"


def run(argv: Sequence[str]) -> int:
    from etcdrun.rendezvous.etcd.core import drain_request

    ns = _parser().parse_args(list(argv))
    keys, client = keys_and_client(ns, "drain")
    with client:
        got = drain_request.request(client, keys, ns.node, _who(), force=ns.force)
    where = f"round {got.round}" if got.round is not None else "no round yet"
    said = "was already asked to drain" if got.already else "asked to drain"
    print(
        f"run {keys.run_id} {where}: node {got.node_id} {said}; {got.remaining} node(s) remain "
        f"(min {got.min_nodes})"
    )
    return 0


def main(argv: Sequence[str]) -> int:
    """Exit codes: 0 asked; 1 refused (unknown node, below min nodes) or etcd failed; 2 a
    usage error. Every failure is one line.
    """
    from etcdrun.rendezvous.client import EtcdError
    from etcdrun.rendezvous.errors import RendezvousError

    try:
        return run(argv)
    except UsageError as exc:
        print(f"etcdrun drain: error: {exc}", file=sys.stderr)
        return 2
    except (EtcdError, RendezvousError) as exc:
        print(f"etcdrun drain: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad --rdzv-conf key or value, a bad run id
        print(f"etcdrun drain: error: {exc}", file=sys.stderr)
        return 2


__all__ = ["main", "run"]
