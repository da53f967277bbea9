"""Node ids people can read: the host plus a short suffix, ``host-b-3f2a9.1``.

Why not ``<host>-<pid>-<6 hex>.<n>``: ``vm-7144-de6ec5.1`` means nothing to a new user
(issue 13); the pid is in the agent's record (``etcdrun status``, and the log lines say "node 2
(host-b, pid 4711)"). What a node id must be, and how this one is:

- unique among the run's live agents: etcd says so — the agent key is created only where none
  exists (Session.open); on a clash the owner draws another suffix (``NodeIdTaken``). Handlers of
  one process (the scale bench runs hundreds) never draw the same suffix;
- new for each incarnation (``.n``: a fenced node rejoins as a new participant, S4), and for each
  agent process (a random suffix: a restarted container with the same host name and pid 1 must
  not take a dead node's place). Two lives of one host share a suffix once in a million, and
  that only matters when etcd's deletion of the old key and the new registration reach the
  leader in one watch batch;
- a key segment: characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable

from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.session import NodeIdTaken, Session
from etcdrun.rendezvous.etcd.node import job_settings
from etcdrun.rendezvous.etcd.node.joining import FoldedJoin

# 5 hex digits: with 4, the scale bench's 1000 handlers on one host clashed often enough (each
# clash costs writes) to push a round past its 3N + 10 writes bound; with 5, clashes are rare
# (bench/results/figures.md).
SUFFIX_HEX = 5
CLASH_TRIES = 8
_taken: set[str] = set()  # suffixes drawn by this process
_lock = threading.Lock()
_BAD = re.compile(r"[^A-Za-z0-9._-]")


def host_part(host: str) -> str:
    """The host as it may appear in a key segment (never empty)."""
    return _BAD.sub("_", host)[:64] or "host"


def draw_suffix() -> str:
    """A random suffix no other handler of this process holds."""
    with _lock:
        while True:
            suffix = os.urandom(4).hex()[:SUFFIX_HEX]
            if suffix not in _taken:
                _taken.add(suffix)
                return suffix


def release_suffix(suffix: str) -> None:
    with _lock:
        _taken.discard(suffix)


def node_id(host: str, suffix: str, incarnation: int) -> str:
    return f"{host_part(host)}-{suffix}.{incarnation}"


def node_name(node: str) -> str:
    """The node id without its ``.<incarnation>``: the same for every session of one agent
    (what a bad-host cooldown counts by, node/cooldown.py). Not the host: agents that share a
    host are different nodes.
    """
    name, dot, n = node.rpartition(".")
    return name if dot and n.isdigit() else node


def register(
    ctx: RunContext,
    host: str,
    suffix: str,
    incarnation: int,
    agent_info: Callable[[str], st.AgentInfo],
    fold: FoldedJoin | None = None,
) -> tuple[Session, str]:
    """Open a session under a readable node id (the job's settings checked around it:
    job_settings.py; ``fold``: its join record with it); on a clash draw another suffix.
    Returns the session and the suffix.
    """
    for attempt in range(CLASH_TRIES):
        info = agent_info(node_id(host, suffix, incarnation))
        try:
            sess = job_settings.open_session(ctx.client, ctx.keys, info, ctx.config.lease_ttl, fold)
            return sess, suffix
        except NodeIdTaken:
            if attempt == CLASH_TRIES - 1:
                raise
            release_suffix(suffix)
            suffix = draw_suffix()
    raise AssertionError("unreachable")


__all__ = ["SUFFIX_HEX", "draw_suffix", "host_part", "node_id", "register", "release_suffix"]
