"""Bad-host cooldown: a node whose workers failed ``cooldown_failures`` times in this job sits
out the rounds for a while, as a spare, and then joins again (docs/hangs.md, "Bad hosts").

Why the node judges itself: it is the one that knows its workers failed (it opens the restart
round with the failure, node/lifecycle.py), and it is the only writer of its record, so it
keeps the record in memory and never reads etcd to count. Its own clock times the cooldown (a
timed wait on a known deadline), and the leader never compares wall clocks across machines
(S5): it reads only the ``resting`` flag the node writes when the cooldown starts and ends.

Why a key per node *name* (the node id without ``.<incarnation>``): a node fenced and back as a
new incarnation is the same machine with the same workers; its failures must still count. The
key lives under the run lease (``RoundState.run_lease``), like the round key: it never outlives
the run.

Why the doubling (Horovod's blacklist does the same): a host that fails again right after its
cooldown is probably still bad, and each return costs the job a round; the cap keeps a
recovered host from being kept out for good.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, replace

from etcdrun.rendezvous.api import FailureInfo
from etcdrun.rendezvous.client import EtcdLeaseNotFoundError
from etcdrun.rendezvous.errors import RendezvousStateError
from etcdrun.rendezvous.etcd.core.context import RunContext
from etcdrun.rendezvous.etcd.core.protocol import Round
from etcdrun.rendezvous.etcd.node.node_names import node_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    """``failures``: how many worker failures charged to a node cool it down (0: never);
    ``base``: the first cooldown, in seconds, doubled at each next one up to ``cap``.
    """

    failures: int = 3
    base: float = 10.0
    cap: float = 300.0


@dataclass(frozen=True)
class Record:
    """What ``cooldown/<node name>`` holds (JSON: people read it with etcdctl). ``failures``
    counts since the last cooldown; ``until_unix`` is the writer's clock, for people only.
    """

    node: str = ""  # the node id (with its incarnation) that wrote it last
    failures: int = 0
    cooldowns: int = 0
    until_unix: float = 0.0
    seconds: float = 0.0
    resting: bool = False
    why: str = ""


def length(policy: Policy, cooldowns: int) -> float:
    """The cooldown after ``cooldowns`` earlier ones: base × 2^cooldowns, capped."""
    return min(policy.base * 2.0 ** min(cooldowns, 64), policy.cap)


def charged(rec: Record, policy: Policy, node: str, why: str, now_unix: float) -> Record:
    """``rec`` after one more failure of this node's workers (pure): the count grows, and at
    ``policy.failures`` the node cools down (``resting``) and its count starts over.
    """
    failures = rec.failures + 1
    if policy.failures <= 0 or failures < policy.failures:
        return replace(rec, node=node, failures=failures, why=why)
    seconds = length(policy, rec.cooldowns)
    return Record(node, 0, rec.cooldowns + 1, now_unix + seconds, seconds, True, why)


def over(rec: Record, node: str) -> Record:
    """``rec`` once its cooldown is over: the node takes part again; the count of cooldowns
    stays (the next one lasts twice as long).
    """
    return replace(rec, node=node, resting=False)


def encode(rec: Record) -> bytes:
    return json.dumps(asdict(rec), sort_keys=True).encode()


def decode(key: bytes | str, value: bytes, run_id: str) -> Record:
    """A record as written by ``encode``; RendezvousStateError naming the key otherwise."""
    try:
        raw = json.loads(value)
        return Record(**{k: raw[k] for k in Record.__dataclass_fields__ if k in raw})
    except (ValueError, TypeError) as e:
        k = key.decode(errors="replace") if isinstance(key, bytes) else key
        raise RendezvousStateError(f"{k} holds no cooldown record: {e}", run_id=run_id) from None


def describe(failure: FailureInfo) -> str:
    how = f"signal {failure.signal_name}" if failure.signal_name else f"exit {failure.exit_code}"
    return f"rank {failure.global_rank} failed ({how})"


class Cooldown:
    """This node's cooldown: its record (this process is its only writer) and, while it rests,
    the monotonic time it may join again. The handler asks ``until()`` before it joins a round
    and calls ``end`` once that time passed.
    """

    def __init__(self, ctx: RunContext) -> None:
        cfg = ctx.config
        self._ctx = ctx
        self.policy = Policy(cfg.cooldown_failures, cfg.cooldown_base, cfg.cooldown_cap)
        self._mu = threading.Lock()
        self._rec = Record()
        self._until: float | None = None

    def until(self) -> float | None:
        """While this node rests: the monotonic time its cooldown ends (maybe passed: then the
        caller ends it). None otherwise.
        """
        return self._until

    def charge(self, running: Round, failure: FailureInfo, node: str) -> None:
        """This node's workers failed in ``running`` and it opened the restart round: count
        it, and cool the node down at the policy's count (before it could join that round).
        Not with the restart budget spent: that round closes the job as failed, unless a lost
        node caused the failure, which then charges nothing. A cooldown there only made the
        failed job wait it out (10 s) before saying so.
        """
        if self.policy.failures <= 0:
            return
        if running.restart_count >= self._ctx.settings.max_restarts:
            return
        with self._mu:
            rec = charged(self._rec, self.policy, node, describe(failure), time.time())
            self._put(rec, running.run_lease, running.number + 1)
            self._rec = rec
            if rec.resting:
                self._until = time.monotonic() + rec.seconds
        if rec.resting:
            self._say_cooled(running, rec, node)

    def end(self, node: str, current: Round | None) -> None:
        """The cooldown is over (its time passed): say so in etcd, so that the leader counts
        this node again (an arrival: a new round when the job is below max nodes).
        """
        with self._mu:
            rec = over(self._rec, node)
            number = current.number if current is not None else None
            self._put(rec, current.run_lease if current is not None else 0, number)
            self._rec, self._until = rec, None
        self._ctx.events.emit("node_cooldown_over", round=number, cooldowns=rec.cooldowns)
        log.warning(
            "run %s round %s: node %s is back from its cooldown and joins the job again",
            self._ctx.keys.run_id,
            number,
            node,
        )

    def _put(self, rec: Record, run_lease: int, number: int | None) -> None:
        """Under the run lease, so the record ends with the run. A run lease already gone (every
        agent was away longer than run_lease_ttl) leaves etcd without the record: the node
        still rests, and the leader waits for it as for any survivor meanwhile.
        """
        key = self._ctx.keys.cooldown(node_name(rec.node))
        try:
            self._ctx.client.put(key, encode(rec), lease=run_lease)
        except EtcdLeaseNotFoundError:
            log.warning(
                "run %s round %s: node %s could not record its cooldown: the run lease %x is gone",
                self._ctx.keys.run_id,
                number,
                rec.node,
                run_lease,
            )

    def _say_cooled(self, running: Round, rec: Record, node: str) -> None:
        """One event and one line; when the job cannot go on without this node, the line says
        so (the others wait, as for any missing node).
        """
        ctx, number = self._ctx, running.number + 1
        ctx.events.emit(
            "node_cooled_down",
            round=number,
            failures=self.policy.failures,
            cooldowns=rec.cooldowns,
            until=rec.until_unix,
            seconds=rec.seconds,
            why=rec.why,
        )
        others, low = running.node_count - 1, ctx.settings.min_nodes
        short = (
            f"; the job has {others} other node(s), below min nodes {low}: it waits for this "
            "node or a new one"
            if others < low
            else ""
        )
        log.warning(
            "run %s round %d: node %s cooled down for %g s after %d worker failures (last: %s); "
            "it waits as a spare until %s%s",
            ctx.keys.run_id,
            number,
            node,
            rec.seconds,
            self.policy.failures,
            rec.why,
            time.strftime("%H:%M:%S", time.localtime(rec.until_unix)),
            short,
        )


__all__ = ["Cooldown", "Policy", "Record", "charged", "decode", "encode", "length", "over"]
