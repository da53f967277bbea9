"""One chaos trial (issue 11): a real 3-member etcd, 3-5 real agents running short real workers,
a seeded fault schedule (chaos_schedule.py) carried out on them (chaos_faults.py), and the
checks after it:

- etcd's history of the round key, recorded live from revision 1 (compaction never passes the
  recorder), through the invariant checker (S1-S6), with every agent's ``round_accepted`` events
  from its events.jsonl (S3/S4);
- /proc sampled every 10 ms (tests/rank_sampler.py): never two running workers with one RANK of
  different rounds;
- the job completes (the run CLOSED SUCCEEDED, every agent not killed exits 0) — the schedules
  always leave at least min nodes alive;
- nothing left: no process carrying the trial's tag, no key but the closed round, no lease but
  its marker.

Recovery: from the first fault that takes a node out of the job (kill -9, a stop past the TTL, a
worker kill) to the moment every worker of the next full round has started (the workers' own
start files). Measured here: a trial takes ~10-14 s on 2 quiet shared cores.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from agent_helpers import Job, clean_env, pid_alive, wait_for
from chaos_faults import NODE_VAR, Busy, Executor, signal_all, tagged
from chaos_netcut import NetCut
from chaos_netcut import leftovers as netcut_leftovers
from chaos_netcut import unavailable as netcut_unavailable
from chaos_schedule import MAX_RESTARTS, TTL, Schedule
from ddp_helpers import worker_stacks
from rank_sampler import RESUME_WINDOW, RankSampler

from etcdrun.agent.hang import stacks
from etcdrun.proto import etcdrun_state_pb2 as st
from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.client.txn import prefix_end
from etcdrun.rendezvous.etcd.core.keys import RunKeys
from etcdrun.rendezvous.localetcd import LocalEtcd
from etcdrun.rendezvous.tools import checker

WORKER = str(Path(__file__).with_name("chaos_worker.py"))
WORK_S = 3.0  # how long each worker runs: a round that lasts this long ends the job
DISRUPTIVE = ("agent_kill", "agent_stop_long", "node_stop_long", "worker_kill", "net_cut_long")
DISRUPTIVE += ("node_kill", "rank0_kill")  # in-place trials' (chaos_inplace.py)


@dataclass
class Result:
    schedule: Schedule
    violations: list[str] = field(default_factory=list)
    lost: bool = False  # the job did not complete though min nodes survived
    recovery: float | None = None
    seconds: float = 0.0
    log: list[str] = field(default_factory=list)
    # seconds after a whole node's resume at which a stale RANK was still seen running (S4's
    # documented whole-node window; reported, never counted as a pass of S4)
    resume_window: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.lost


class Recorder:
    """Every version of the round key from revision 1, kept as it happens (a watch callback),
    so that a compaction mid-trial cannot take the history the checker needs. The watch spans
    the round key and rounds/, so that a sharded round is put together from its shard keys
    (checker.assemble), as the checker does from etcd's history.
    """

    def __init__(self, endpoints: str, keys: RunKeys) -> None:
        self.keys = keys
        self._events: list = []  # of the round key and of the shard keys, in commit order
        self._mu = threading.Lock()
        self.errors: list[str] = []
        self.client = EtcdClient(endpoints, retry_timeout=30.0)
        self.watch = self.client.watch(
            keys.round, range_end=prefix_end(keys.rounds), start_revision=1, callback=self._got
        )

    @property
    def versions(self) -> list[checker.Version]:
        with self._mu:
            events = list(self._events)
        return checker.assemble(events, self.keys)

    def _got(self, batch) -> None:
        if batch.error is not None:
            self.errors.append(f"history watch ended: {batch.error}")
        kept = [ev for ev in batch.events if self.keys.parse(ev.kv.key)[0] in ("round", "shard")]
        with self._mu:
            self._events += kept

    def resume_revision(self) -> int:
        return max(self.watch.next_revision, 1)

    def close(self) -> None:
        self.watch.cancel()
        self.client.close()


class Trial:
    START_S = 60  # for the first full round: agents and workers started on loaded cores
    END_S = 90  # for every agent not killed to exit, once the faults are over

    def __init__(self, schedule: Schedule, etcd_bin: str, root: Path) -> None:
        self.s = schedule
        self.etcd_bin = etcd_bin
        self.root = root
        self.tag = f"chaos{schedule.seed}-{uuid.uuid4().hex[:6]}"
        self.keys = RunKeys("/etcdrun", self.tag)
        self.result = Result(schedule)

    def run(self) -> Result:
        t_begin = time.monotonic()
        cut = {f.target for f in self.s.faults if f.kind.startswith("net_cut")}
        why = netcut_unavailable() if cut else None
        if why is not None:
            raise RuntimeError(f"seed {self.s.seed} cuts a node's network, which needs root: {why}")
        with ExitStack() as stack:
            cuts = {i: NetCut(f"{self.tag}-{i}") for i in sorted(cut)}
            for c in cuts.values():
                stack.callback(c.close)  # after the teardown: nothing is left in the groups
            etcd = stack.enter_context(LocalEtcd(3, etcd_bin=self.etcd_bin))
            rec = Recorder(etcd.endpoints, self.keys)
            stack.callback(rec.close)
            sampler = stack.enter_context(self._sampler())
            if self.s.busy:
                stack.enter_context(Busy(clean_env()))
            job = self._job(etcd, cuts)
            stack.callback(self._teardown, job)
            ex = self._executor(etcd, job, rec, cuts)
            codes = self._play(job, ex)
            etcd.wait_healthy(30)  # every fault is over: a member down is restarted
            self._check(etcd, job, rec, codes)
            self._check_workers(job, ex)
        self._overlaps(sampler, ex)
        self.result.violations += [f"left behind: {x}" for x in netcut_leftovers(self.tag)]
        self.result.violations += rec.errors
        self.result.log += [f"{t:.3f} {what}" for t, what in ex.log]
        self.result.seconds = time.monotonic() - t_begin
        return self.result

    # ---- what an in-place trial (chaos_inplace.py) changes ------------------------------------
    def _sampler(self) -> RankSampler:
        return RankSampler(self.tag, running_only=True)

    def _executor(self, etcd: LocalEtcd, job: Job, rec: Recorder, cuts: dict) -> Executor:
        return Executor(etcd, job.agents, self.tag, self.keys.root, rec.resume_revision, cuts)

    def _worker_args(self, job: Job) -> tuple[str, ...]:
        return (WORKER, str(job.out), str(WORK_S))

    def _killed(self, ex: Executor) -> set[int]:
        return self.s.killed()

    def _check_workers(self, job: Job, ex: Executor) -> None:
        """More checks of what the workers left (none for restart trials)."""

    def _overlaps(self, sampler: RankSampler, ex: Executor) -> None:
        """Two running workers with one RANK: a violation, except in the known window right
        after a whole node frozen past the TTL is resumed (design.md S4: its warden resumes
        with its workers and needs a moment to kill them; nothing on a frozen node can act).
        """
        resumed = [t for t, what in ex.log if what == "end of node_stop_long"]
        for line, t in zip(sampler.overlaps, sampler.overlap_times, strict=True):
            after = [t - r for r in resumed if 0 <= t - r <= RESUME_WINDOW]
            if after:
                self.result.resume_window.append(min(after))
            else:
                self.result.violations.append(f"/proc: {line}")

    def _job(self, etcd: LocalEtcd, cuts: dict[int, NetCut]) -> Job:
        s = self.s
        conf = f"lease_ttl={TTL},last_call_timeout=0.5,join_timeout=30"
        conf += ",shard_at=2" if s.sharded else ""
        extra = ("--max-restarts", str(MAX_RESTARTS))
        job = Job(
            etcd.endpoints,
            self.root,
            nnodes=f"{s.min_nodes}:{s.max_nodes}",
            nproc=s.nproc,
            conf=conf,
            extra=extra,
            run_id=self.tag,
        )
        for i in range(s.agents):
            self._start_agent(job, i, cuts)
        return job

    def _start_agent(self, job: Job, i: int, cuts: dict[int, NetCut]) -> None:
        """Agent ``i`` (a node tagged ``<tag>-<i>``), logging to ``logs<i>``."""
        env = clean_env(ETCDRUN_TEST_JOB=self.tag, **{NODE_VAR: f"{self.tag}-{i}"})
        env.update(stacks.env(str(self.root / f"stacks{i}.log")))  # read if the agent hangs
        logs = self.root / f"logs{i}"
        wrap = cuts[i].wrap if i in cuts else ()  # a node to cut starts in its group
        job.start(*self._worker_args(job), env=env, extra=("--log-dir", str(logs)), wrap=wrap)

    def _play(self, job: Job, ex: Executor) -> list[int | None]:
        """The first full round, the faults, and every agent's exit code (None: killed)."""
        world = self.s.agents * self.s.nproc
        job.wait_round(world, timeout=self.START_S)
        (job.out / "go").touch()  # the workers' work starts now (tests/chaos/chaos_worker.py)
        t0 = time.monotonic()
        ex.run(self.s.faults, t0)
        killed = self._killed(ex)
        deadline = time.monotonic() + self.END_S
        for i, a in enumerate(job.agents):
            if i not in killed:
                try:
                    a.wait(max(0.1, deadline - time.monotonic()))
                except AssertionError as e:
                    self.result.log.append(f"agent{i} hung: {str(e)[-1500:]}")
                    self.result.log.append(self._stacks(job, i))
        self.result.recovery = self._recovery(job, ex)
        return [None if i in killed else a.proc.poll() for i, a in enumerate(job.agents)]

    def _stacks(self, job: Job, i: int) -> str:
        """Where agent ``i``'s live workers are, as the hang watchdog dumps them: a hang that
        a replay does not show again is then read from the trial that had it.
        """
        a = job.agents[i]
        if a.proc.poll() is not None:
            return f"  agent{i} exited: no worker stacks"
        got = worker_stacks(a.pid, str(self.root / f"stacks{i}.log"), 3000)
        return "\n".join(f"  agent{i}'s worker {pid}:\n{text}" for pid, text in got.items())

    def _recovery(self, job: Job, ex: Executor) -> float | None:
        hits = [t for t, what in ex.log if what.split()[1:2] and what.split()[1] in DISRUPTIVE]
        if not hits:
            return None
        t_fault = hits[0]
        for _n, starts in sorted(job.rounds().items()):  # read once every agent is done
            if min(s.t for s in starts) < t_fault:
                continue
            world = starts[0].world_size
            if {s.rank for s in starts} == set(range(world)):
                return max(s.t for s in starts) - t_fault
        return None  # no new round was needed (the workers had finished), or none came

    def _check(self, etcd: LocalEtcd, job: Job, rec: Recorder, codes: list) -> None:
        r = self.result
        wait_for(
            lambda: rec.versions and rec.versions[-1].revision >= self._round_rev(etcd),
            30,
            "the history recorder to catch up",
        )
        accepted = self._accepted()
        found = checker.check(rec.versions, self.s.min_nodes, self.s.max_nodes, accepted)
        if found:  # the history itself, for the report
            r.log += [f"history: {_brief(v)}" for v in rec.versions]
        r.violations += found
        # The last state written (the CLOSED marker may have expired since: join_timeout).
        last = next((v.state for v in reversed(rec.versions) if v.state is not None), None)
        closed = last is not None and last.phase == st.CLOSED
        succeeded = closed and last.outcome == st.SUCCEEDED
        bad_exits = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if not succeeded or bad_exits:
            r.lost = True
            r.log.append(f"job lost: run closed={closed} succeeded={succeeded} exits={codes}")
        r.violations += self.leftovers(etcd.endpoints, within=3 * TTL + 2)

    def _round_rev(self, etcd: LocalEtcd) -> int:
        with EtcdClient(etcd.endpoints) as c:
            kv = c.get(self.keys.round)
            return kv.mod_revision if kv is not None else 0

    def _accepted(self) -> list[dict]:
        out = []
        for path in self.root.glob("logs*/events.jsonl"):
            for line in path.read_text().splitlines():
                ev = json.loads(line)
                if ev.get("event") == "round_accepted" and ev.get("run_id") == self.tag:
                    out.append(ev)
        return out

    def leftovers(self, endpoints: str, within: float) -> list[str]:
        """Processes now; keys and leases once the killed agents' leases had time to expire
        (``within``: their TTL and the leader's notice).
        """
        found = []
        try:
            wait_for(lambda: not tagged(f"ETCDRUN_TEST_JOB={self.tag}"), 3, "no process left")
        except AssertionError:
            found.append(f"processes left: {tagged(f'ETCDRUN_TEST_JOB={self.tag}')}")
        with EtcdClient(endpoints) as c:

            def clean() -> bool:
                keys = [kv.key.decode() for kv in c.get_prefix(self.keys.root).kvs]
                marker = c.get(self.keys.round)
                leases = set(c.leases()) - ({marker.lease} if marker is not None else set())
                self._left = (keys, leases)
                return keys in ([self.keys.round], []) and not leases

            try:
                wait_for(clean, within, "only the closed round key left")
            except AssertionError:
                found.append(f"left in etcd: keys {self._left[0]}, leases {self._left[1]}")
        return found

    def _teardown(self, job: Job) -> None:
        job.close()
        pids = tagged(f"ETCDRUN_TEST_JOB={self.tag}")
        signal_all(pids, 9)
        for pid in pids:
            wait_for(lambda p=pid: not pid_alive(p), 5, f"pid {pid} gone")
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def _brief(v: checker.Version) -> str:
    if v.state is None:
        return f"@{v.revision} {v.problem or 'deleted'}"
    s = v.state
    text = str(s).replace("\n", " ")[:600]
    return f"@{v.revision} round {s.number} {st.Phase.Name(s.phase)}: {text}"
