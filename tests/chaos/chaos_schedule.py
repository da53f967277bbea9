"""Seeded random fault schedules for the chaos trials (issue 11): a pure function of one int.

Why pure and seeded: a failing trial must replay exactly (``bench/soak.py --replay <seed>``),
so everything random about a trial — how many agents, which faults, when, on whom, for how long,
whether the cores are saturated — is drawn here from ``random.Random(seed)`` and nothing else.
The executor (chaos_trial.py) only carries the schedule out.

What a schedule keeps true, so that the job must complete (issue 11: "whenever at least min nodes
survive"): at most ``agents - min_nodes`` agents are killed, each at most once, and the restart
budget covers every worker kill. Everything else (stops, etcd restarts, compaction, corrupt
values, network cuts) must cost at most new rounds, never the job.

The schedules changed on 2026-12-01 (network cuts added): a seed names another schedule than it
did before; the soak figures in README say which set they ran.

In-place trials (issue 29): about a third of the seeds (drawn apart, ``in_place(seed)``, so that
the other seeds keep the schedules they had) run workers that opt in through ``etcdrun.elastic``
(chaos_elastic_worker.py) under the faults that in-place rounds answer: kill -9 of a whole node
and of the node holding RANK 0 then, kill -9 of the agent alone, SIGSTOP of the agent and of the
whole node within and past the TTL, and a newcomer arriving. Fewer agents and processes (3-4 x
1-2) than restart trials: every worker imports torch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

TTL = 2  # lease_ttl of every trial: short, so that many trials fit

# kind -> (weight, how long it lasts in s: (lo, hi), or None for an instant fault)
FAULTS: dict[str, tuple[int, tuple[float, float] | None]] = {
    "agent_kill": (3, None),  # kill -9 of the agent (its warden fences the workers)
    "agent_stop_short": (2, (0.5, 1.0)),  # SIGSTOP of the agent alone, < presumed loss (1.44 s)
    "agent_stop_long": (2, (TTL + 0.5, TTL + 2.0)),  # ... past the TTL: fenced, rejoins
    "node_stop_short": (2, (0.5, 1.0)),  # SIGSTOP of the whole node tree (agent, warden, workers)
    "node_stop_long": (2, (TTL + 0.5, TTL + 2.0)),
    "worker_kill": (3, None),  # kill -9 of one worker: a charged restart
    "etcd_leader_restart": (2, (0.2, 1.5)),  # kill -9 of the raft leader, restarted after
    "etcd_follower_restart": (2, (0.2, 1.5)),
    "etcd_all_restart": (1, (0.3, 1.0)),  # every member down at once, then all restarted
    "compact": (2, None),  # compaction of etcd's history up to now
    "corrupt_agent": (1, None),  # an etcdctl-style put of garbage into an agent key
    "corrupt_round": (1, None),  # ... into the round key
    "net_cut_short": (2, (0.5, 1.0)),  # every packet the node sends dropped (chaos_netcut.py)
    "net_cut_long": (2, (TTL + 0.5, TTL + 2.0)),  # ... past the TTL: it fences itself, rejoins
}
TARGETED = {"agent_kill", "agent_stop_short", "agent_stop_long", "node_stop_short"}
TARGETED |= {"node_stop_long", "worker_kill", "corrupt_agent", "net_cut_short", "net_cut_long"}
MAX_RESTARTS = 3  # >= the worker kills a schedule holds

# The in-place trials' faults (chaos_inplace.py carries out the three new kinds).
IN_PLACE_FAULTS: dict[str, tuple[int, tuple[float, float] | None]] = {
    "node_kill": (3, None),  # kill -9 of every process of the node: agent, warden, workers
    "rank0_kill": (2, None),  # ... of the node whose worker holds RANK 0 at that moment
    "agent_kill": (2, None),  # the agent alone: its warden fences the opted-in workers
    **{k: FAULTS[k] for k in FAULTS if k.startswith(("agent_stop", "node_stop"))},
    "newcomer": (2, None),  # one more agent starts: the kept workers take it in
}
IN_PLACE_TARGETED = {"node_kill", "agent_kill"} | {k for k in IN_PLACE_FAULTS if "stop" in k}
KILLS = ("agent_kill", "node_kill", "rank0_kill")  # each costs the job a node for good
IN_PLACE_SHARE = 0.3
SHARDED_SHARE = 0.5  # of every kind of trial: sharded rounds meet every fault (issue 31)


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the first full round is running
    kind: str
    target: int = -1  # the agent's index (start order), for targeted faults
    duration: float = 0.0  # how long a stop or an etcd outage lasts

    def describe(self) -> str:
        who = f" agent{self.target}" if self.target >= 0 else ""
        lasting = f" for {self.duration:.2f}s" if self.duration else ""
        return f"t+{self.at:.2f}s {self.kind}{who}{lasting}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    agents: int  # 3-5 agents, --nnodes min_nodes:agents
    min_nodes: int
    nproc: int
    busy: bool  # every core saturated by other processes for the whole trial
    faults: tuple[Fault, ...]
    in_place: bool = False  # the workers opt in through etcdrun.elastic (chaos_inplace.py)
    sharded: bool = False  # every frozen round sharded (shard_at=2): nodes watch their shards

    @property
    def max_nodes(self) -> int:
        return self.agents + sum(f.kind == "newcomer" for f in self.faults)

    def killed(self) -> set[int]:
        """The agents killed by index (a rank-0 kill's node is known only when it happens)."""
        return {f.target for f in self.faults if f.kind in KILLS and f.target >= 0}

    def describe(self) -> str:
        head = f"seed {self.seed}: {self.agents} agents (min {self.min_nodes}) x {self.nproc}"
        head += ", in place" if self.in_place else ""
        head += ", sharded" if self.sharded else ""
        busy = ", cores saturated" if self.busy else ""
        return f"{head}{busy}; " + "; ".join(f.describe() for f in self.faults)


def in_place(seed: int) -> bool:
    """Whether seed's trial runs in place: drawn from its own stream, so that the restart
    seeds' schedules are the ones they were before in-place trials came.
    """
    return random.Random(f"in-place {seed}").random() < IN_PLACE_SHARE


def sharded(seed: int) -> bool:
    """Whether seed's trial shards its rounds (design.md §2, ``shard_at=2``): drawn from its
    own stream, so that every other draw of the seed stays as it was.
    """
    return random.Random(f"sharded {seed}").random() < SHARDED_SHARE


def generate(seed: int) -> Schedule:
    """The schedule of trial ``seed``: 1-3 faults within the first 2 s of the running job."""
    return replace(_generate(seed), sharded=sharded(seed))


def _generate(seed: int) -> Schedule:
    if in_place(seed):
        return _generate_in_place(seed)
    rng = random.Random(seed)
    agents = rng.randint(3, 5)
    min_nodes = 2
    kinds = list(FAULTS)
    weights = [FAULTS[k][0] for k in kinds]
    faults: list[Fault] = []
    kills_left = agents - min_nodes
    worker_kills_left = MAX_RESTARTS
    for _ in range(rng.randint(1, 3)):
        kind = rng.choices(kinds, weights)[0]
        if kind == "agent_kill" and kills_left == 0:
            kind = "agent_stop_long"
        if kind == "worker_kill" and worker_kills_left == 0:
            kind = "compact"
        kills_left -= kind == "agent_kill"
        worker_kills_left -= kind == "worker_kill"
        span = FAULTS[kind][1]
        duration = round(rng.uniform(*span), 2) if span else 0.0
        target = _target(rng, kind, agents, faults)
        faults.append(Fault(round(rng.uniform(0.0, 2.0), 2), kind, target, duration))
    faults.sort(key=lambda f: f.at)
    return Schedule(seed, agents, min_nodes, rng.choice((1, 2)), rng.random() < 0.2, tuple(faults))


def _generate_in_place(seed: int) -> Schedule:
    """An in-place trial's schedule: 1-3 faults of IN_PLACE_FAULTS within the first 2 s; at
    most ``agents - min_nodes`` kills; a newcomer is the next agent by index, in start order
    (the trial's agents are listed in the order they started).
    """
    rng = random.Random(seed)
    agents = rng.randint(3, 4)
    kinds = list(IN_PLACE_FAULTS)
    weights = [IN_PLACE_FAULTS[k][0] for k in kinds]
    faults: list[Fault] = []
    kills_left, newcomers = agents - 2, 0
    for _ in range(rng.randint(1, 3)):
        kind = rng.choices(kinds, weights)[0]
        if kind in KILLS and kills_left == 0:
            kind = "node_stop_long"
        kills_left -= kind in KILLS
        span = IN_PLACE_FAULTS[kind][1]
        duration = round(rng.uniform(*span), 2) if span else 0.0
        target = _target(rng, kind, agents, faults, IN_PLACE_TARGETED)
        faults.append(Fault(round(rng.uniform(0.0, 2.0), 2), kind, target, duration))
    faults.sort(key=lambda f: f.at)
    for n, f in enumerate(faults):  # newcomers numbered in the order they start
        if f.kind == "newcomer":
            faults[n], newcomers = replace(f, target=agents + newcomers), newcomers + 1
    nproc = 1 if agents == 4 else rng.choice((1, 2))
    return Schedule(seed, agents, 2, nproc, rng.random() < 0.1, tuple(faults), in_place=True)


def _target(
    rng: random.Random, kind: str, agents: int, earlier: list[Fault], targeted: set[str] = TARGETED
) -> int:
    """A targeted fault's agent; never one already killed (a kill -9 happens once)."""
    if kind not in targeted:
        return -1
    dead = {f.target for f in earlier if f.kind in KILLS}
    return rng.choice([i for i in range(agents) if i not in dead])
