"""How an operator's command reaches a running job in etcd: the job's own ``--rdzv-endpoint``,
``--rdzv-id`` and ``--rdzv-conf`` (prefix, TLS and auth keys), with the agent's ``PET_*``
defaults, shared by ``etcdrun status`` and ``etcdrun drain``.

Why shared: an operator who can see a run must be able to drain one of its nodes with exactly
the same flags and environment (etcdctl's variables included), and the two commands must not
drift apart on how a TLS endpoint or an auth setting is spelled.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from etcdrun.agent.flags import UsageError, parse_rdzv_conf


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not usage + message
        raise UsageError(message)


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=os.environ.get("PET_RDZV_ENDPOINT", ""),
        help="etcd endpoints, as for the job",
    )
    p.add_argument(
        "--rdzv-id", "--rdzv_id", default=os.environ.get("PET_RDZV_ID", ""), help="the job's run id"
    )
    p.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default=os.environ.get("PET_RDZV_CONF", ""),
        help="prefix, TLS and auth keys, as for the job",
    )


# An agent rides out an etcd failover for retry_timeout (30 s); an operator at a prompt is
# better served by a quick answer, since a mistyped endpoint looks exactly like an outage.
# The job's own --rdzv-conf retry_timeout, when given, still wins.
OPERATOR_RETRY_TIMEOUT = "5"


def run_config(ns: argparse.Namespace) -> Any:
    """The job's etcd settings as ``--rdzv-conf`` gives them (EtcdRendezvousConfig)."""
    from etcdrun.rendezvous.etcd.core.rdzv_conf import etcd_config

    conf = parse_rdzv_conf(ns.rdzv_conf)
    conf.setdefault("retry_timeout", OPERATOR_RETRY_TIMEOUT)
    return etcd_config(conf)


def keys_and_client(ns: argparse.Namespace, command: str) -> tuple[Any, Any]:
    """The run's keys and a client for its etcd (not yet connected: the first call connects)."""
    from etcdrun.rendezvous.etcd.core.keys import RunKeys

    if not ns.rdzv_endpoint.strip() or not ns.rdzv_id.strip():
        raise UsageError(f"{command} needs --rdzv-endpoint and --rdzv-id (the job's own)")
    cfg = run_config(ns)
    keys = RunKeys(cfg.prefix, ns.rdzv_id)
    from etcdrun.rendezvous.client import EtcdClient

    return keys, EtcdClient(cfg.client_config(ns.rdzv_endpoint))


__all__ = ["OneLineParser", "add_run_flags", "keys_and_client", "run_config"]
