"""The key layout of one run (design.md §2). Everything of a run lives under one prefix.

Round numbers are zero-padded so that key order is numeric order: one DeleteRange
``[rounds/, rounds/<n>)`` removes every older round's records in the transaction that opens
round n, and nothing grows with the number of rounds.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from etcdrun.rendezvous.api import check_run_id

_ROUND_DIGITS = 10


_DEFAULT_IDS = ("", "none")  # torchrun's and the reference's default id


def require_run_id(run_id: str) -> None:
    """The etcd backend refuses torchrun's default id: with it, strangers' jobs would meet."""
    if run_id in _DEFAULT_IDS:
        raise ValueError(
            "the etcd backend needs a run id that every node of the job passes, and no "
            "other job uses (--rdzv-id job42): with the default 'none' strangers' jobs "
            "would meet in one run"
        )


def one_node_run_id(run_id: str, max_nodes: int) -> str:
    """``run_id``; for a job of one node given none (the default), a unique one instead.

    Why: torch's launcher gives a random id when none is given, and one node has nobody to meet
    on it, so nothing is lost. A job of more nodes keeps ``require_run_id``'s refusal: on random
    ids its nodes would never meet.
    """
    return uuid.uuid4().hex if run_id in _DEFAULT_IDS and max_nodes == 1 else run_id


@dataclass(frozen=True)
class RunKeys:
    prefix: str
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @property
    def root(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.run_id}/"

    @property
    def agents(self) -> str:
        return self.root + "agents/"

    def agent(self, node_id: str) -> str:
        return self.agents + node_id

    @property
    def lease_terms(self) -> str:
        """Each agent's term mark (session.py): the etcd raft term in which it last renewed its
        lease, under that lease. Why: a new etcd leader renews every lease, so a lease's time
        left tells a live agent from a dead one only once its agent renewed in the new term
        (``etcdrun status`` says "unknown" until then). Outside agents/, so that no agent's
        watch carries it.
        """
        return self.root + "term/"

    def lease_term(self, node_id: str) -> str:
        return self.lease_terms + node_id

    @property
    def tail(self) -> str:
        """The node id of the agent registered last, put by the Txn that registered it and
        under its lease (session.py); the next registration reads it there as its predecessor
        in line (election.py). Outside agents/ and rounds/, so that no agent's watch carries it.
        """
        return self.root + "tail"

    @property
    def round(self) -> str:
        return self.root + "round"

    @property
    def rounds(self) -> str:
        return self.root + "rounds/"

    def round_dir(self, n: int) -> str:
        return f"{self.rounds}{n:0{_ROUND_DIGITS}d}/"

    def joined(self, n: int) -> str:
        return self.round_dir(n) + "joined/"

    def join(self, n: int, node_id: str) -> str:
        return self.joined(n) + node_id

    @property
    def hangs(self) -> str:
        """The hang watchdogs' notices (design.md §4b), apart from ``rounds/`` so that the
        leader's watch of the rounds never carries them.
        """
        return self.root + "hang/"

    def hang(self, n: int, kind: str, node_id: str = "") -> str:
        """Round n's ``alarm`` and ``verdict`` (one each), and each node's ``report``."""
        key = f"{self.hangs}{n:0{_ROUND_DIGITS}d}/{kind}"
        return f"{key}/{node_id}" if node_id else key

    def hint(self, n: int) -> str:
        """The previous round's participants, for ordering round n (read by the leader only,
        so that the round key every agent watches stays small).
        """
        return self.round_dir(n) + "hint"

    @property
    def shards(self) -> str:
        """The run's shard keys (shards.py): a sharded round's participants, by hash of the
        node id, written by the Txn that froze it. The same keys every sharded round, so that a
        node watches its own from its registration on; their value names the round. Under
        rounds/ (so they go with the run's records) but after every round's directory, so that
        dropping the older rounds leaves them.
        """
        return self.rounds + "shard/"

    def shard(self, i: int) -> str:
        return f"{self.shards}{i}"

    def barrier(self, n: int, name: str) -> str:
        return f"{self.round_dir(n)}barrier/{name}/"

    @property
    def drains(self) -> str:
        """Drain requests (``etcdrun drain``): outside agents/ and rounds/, so the leader's
        watches never see them; each node watches its own key only.
        """
        return self.root + "drain/"

    def drain(self, node_id: str) -> str:
        return self.drains + node_id

    def parse_drain(self, key: bytes | str) -> str:
        """The node id of a key under drain/ ("" for any other key)."""
        k = key.decode() if isinstance(key, bytes) else key
        return k[len(self.drains) :] if k.startswith(self.drains) else ""

    @property
    def signalled_rounds(self) -> str:
        """Which nodes of a round a signal took (rendezvous/etcd/node/signalled.py): written only
        when a node is signalled, under the run lease; outside agents/ and rounds/.
        """
        return self.root + "signalled/"

    def signalled(self, round_number: int) -> str:
        return f"{self.signalled_rounds}{round_number}"

    @property
    def cooldowns(self) -> str:
        """Bad-host cooldowns (rendezvous/etcd/node/cooldown.py): one key per node name (the
        node id without its ``.<incarnation>``), so a node's failures count across its
        sessions. Outside agents/ and rounds/: the leader watches this prefix apart.
        """
        return self.root + "cooldown/"

    def cooldown(self, name: str) -> str:
        return self.cooldowns + name

    @property
    def kept_rounds(self) -> str:
        """The rounds taken in place (design.md §4a), one key per round written by the node
        ranked 0 in it, for ``etcdrun status``; outside rounds/ so no agent's watch carries them.
        """
        return self.root + "kept/"

    def kept(self, n: int) -> str:
        return f"{self.kept_rounds}{n:0{_ROUND_DIGITS}d}"

    @property
    def paces(self) -> str:
        """Each node's published pace (rendezvous/etcd/core/stragglers.py), on its session lease:
        at most one write per node per 5 s. Outside rounds/: the leader watches it apart.
        """
        return self.root + "progress/"

    def pace(self, node_id: str) -> str:
        return self.paces + node_id

    def parse(self, key: bytes | str) -> tuple[str, int | None, str | None]:
        """Classify a key of this run: ("agent", None, node) | ("round", None, None) |
        ("join", n, node) | ("hint", n, None) | ("shard", None, index) | ("barrier", n, node) |
        ("cooldown", None, node name) | ("kept", n, None) | ("progress", None, node) |
        ("other", None, None).
        """
        k = key.decode() if isinstance(key, bytes) else key
        if k == self.round:
            return "round", None, None
        if k.startswith(self.agents):
            return "agent", None, k[len(self.agents) :]
        if k.startswith(self.cooldowns):
            return "cooldown", None, k[len(self.cooldowns) :]
        if k.startswith(self.kept_rounds) and k[len(self.kept_rounds) :].isdigit():
            return "kept", int(k[len(self.kept_rounds) :]), None
        if k.startswith(self.paces):
            return "progress", None, k[len(self.paces) :]
        if k.startswith(self.rounds):
            parts = k[len(self.rounds) :].split("/")
            if parts == [parts[0], "hint"] and parts[0].isdigit():
                return "hint", int(parts[0]), None
            if len(parts) == 2 and parts[0] == "shard":
                return "shard", None, parts[1]
            if len(parts) >= 3 and parts[0].isdigit():
                kind = "join" if parts[1] == "joined" else "barrier"
                return kind, int(parts[0]), parts[-1]
        return "other", None, None
