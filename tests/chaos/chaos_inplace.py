"""In-place chaos trials (issue 29): the workers opt in through ``etcdrun.elastic``
(chaos_elastic_worker.py), so a membership change keeps them instead of restarting them. The
trial is chaos_trial.py's — the same etcd, agents, history checker (S1-S6), job completion and
leftovers — with what in place changes and adds:

- who holds which RANK: a kept worker's /proc environment is the one it started with, so the
  sampler (``HeldSampler``) reads the (RANK, round) the worker says it holds now, from its
  ``held_<pid>.json``; a worker that left its round holds nothing until it enters the next;
- the faults in-place rounds answer (chaos_schedule.IN_PLACE_FAULTS): kill -9 of a whole node,
  of the node holding RANK 0 (found when the fault comes), and a newcomer (one more agent);
- kept: the workers of every node no fault touched are the processes that started, through
  every round: none is stopped by its agent after the go before it trained to the end;
- fenced: a node whose agent stayed frozen past its TTL (the agent alone or the whole node)
  never hands a later round to the workers it had: S4 holds for workers that opted in. A stop
  overlapped by a shorter one on the same node ends at the shorter one's SIGCONT, so the freeze
  counted is the agent's own, from its SIGSTOP to its first SIGCONT;
- no step done twice by one process (the step in flight is computed again, never logged).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path

from agent_helpers import Job
from chaos_faults import NODE_VAR, Executor, signal_all
from chaos_schedule import TTL, Fault, Schedule
from chaos_trial import Recorder, Trial
from etcd_helpers import pid_alive
from rank_sampler import RESUME_WINDOW, RankSampler

from etcdrun.rendezvous.localetcd import LocalEtcd

WORKER = str(Path(__file__).with_name("chaos_elastic_worker.py"))
STEPS, STEP_S = 160, 0.05  # ~8 s of training: past every fault, its recovery and a newcomer


def _starttime(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def held(out: Path, pid: int) -> dict | None:
    """What worker ``pid`` says it holds now, or None when it has not said (it has not entered
    a round yet: its environment is right) or the file is an earlier process's (a reused pid).
    """
    try:
        data = json.loads((out / f"held_{pid}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if data.get("start") == _starttime(pid) else None


class HeldSampler(RankSampler):
    """The rank sampler, with each worker's (RANK, round) taken from what it holds now.

    Why read twice: a worker's file changes as it leaves a round and enters the next, and one
    pass over the files is no snapshot. A value read the same before and after the whole first
    pass was held at the moment between the passes by every worker so read (a worker never goes
    back to a round it left); one that changed is left to the next sample, 10 ms later.
    """

    def __init__(self, job_tag: str, out: Path) -> None:
        super().__init__(job_tag, running_only=True)
        self.out = out

    def _processes(self):
        found = list(super()._processes())
        first = [held(self.out, pid) for pid, _, _ in found]
        for (pid, state, env), was in zip(found, first, strict=True):
            if held(self.out, pid) != was:
                continue
            if was is None:
                yield pid, state, env
            elif was["rank"] is not None:
                rank, rnd = str(was["rank"]).encode(), str(was["round"]).encode()
                yield pid, state, {**env, b"RANK": rank, b"ETCDRUN_ROUND": rnd}


class InPlaceExecutor(Executor):
    """The chaos executor with the in-place faults; ``killed`` says which agents it killed (a
    rank-0 kill's node is found when it comes) and ``long_stops`` (agent index, kind, wall time
    of its SIGSTOP and of its first SIGCONT after it) which agents were frozen past the TTL.
    """

    def __init__(self, *args, spawn, out: Path) -> None:
        super().__init__(*args)
        self.spawn, self.out = spawn, out
        self.killed: set[int] = set()
        self.long_stops: list[list] = []
        self._frozen: dict[int, list] = {}  # agent pid -> its open long stop's record

    def _actions(self, f: Fault):
        if f.kind == "node_kill":
            return lambda: self._kill_node(f.target), None
        if f.kind == "rank0_kill":
            return lambda: self._kill_node(self._rank0()), None
        if f.kind == "newcomer":
            return lambda: self.spawn(f.target), None
        start, end = super()._actions(f)
        if not f.kind.endswith("stop_long"):
            return start, end

        def stop() -> None:
            mark = [f.target, f.kind, time.time(), None]
            self.long_stops.append(mark)
            self._frozen.setdefault(self.agents[f.target].pid, mark)
            start()

        return stop, end

    def _cont(self, pids: list[int]) -> None:
        super()._cont(pids)
        for pid in pids:
            mark = self._frozen.pop(pid, None)
            if mark is not None:
                mark[3] = time.time()

    def _kill_agent(self, i: int) -> None:
        self.killed.add(i)
        super()._kill_agent(i)

    def _kill_node(self, i: int) -> None:
        if i < 0:
            return
        self.killed.add(i)
        signal_all(self.node(i), signal.SIGKILL)

    def _rank0(self) -> int:
        """The node of the live worker that entered the latest round as RANK 0 (-1: none)."""
        latest = (-1, -1)
        for path in self.out.glob("start_*_0_*.json"):
            rnd, _, pid = (int(x) for x in path.stem.split("_")[1:])
            if pid_alive(pid) and rnd > latest[0]:
                latest = (rnd, pid)
        node = _node_of(latest[1], self.tag) if latest[1] > 0 else -1
        self.log.append((time.time(), f"rank0_kill: agent{node} (round {latest[0]})"))
        return node


def _node_of(pid: int, tag: str) -> int:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return -1
    want = f"{NODE_VAR}={tag}-".encode()
    found = [int(e[len(want) :]) for e in env if e.startswith(want)]
    return found[0] if found else -1


class InPlaceTrial(Trial):
    """A chaos trial whose workers opt in (see the module docstring for what it checks)."""

    START_S = 120  # every worker (and every agent's standby) imports torch: at nice 5 beside
    END_S = 180  # a load average of 30 here, each import took over a minute (seed 1016)

    def _sampler(self) -> RankSampler:
        return HeldSampler(self.tag, self.root / "out")

    def _executor(self, etcd: LocalEtcd, job: Job, rec: Recorder, cuts: dict) -> Executor:
        return InPlaceExecutor(
            etcd,
            job.agents,
            self.tag,
            self.keys.root,
            rec.resume_revision,
            cuts,
            spawn=lambda i: self._start_agent(job, i, cuts),
            out=job.out,
        )

    def _worker_args(self, job: Job) -> tuple[str, ...]:
        return (WORKER, str(job.out), str(STEPS), str(STEP_S))

    def _killed(self, ex: Executor) -> set[int]:
        assert isinstance(ex, InPlaceExecutor)
        return ex.killed

    def _play(self, job: Job, ex: Executor) -> list[int | None]:
        """As a restart trial's, but a newcomer that came once the job had ended is refused,
        rightly ("already ran", exit 1): its standby warms for seconds on loaded cores, and
        training may be over by then (seed 1017).
        """
        codes = super()._play(job, ex)
        for i in range(self.s.agents, len(codes)):
            if codes[i] == 1 and "already ran" in job.agents[i].stderr:
                codes[i] = 0
                self.result.log.append(f"agent{i}, a newcomer, came after the end: refused")
        return codes

    def _check_workers(self, job: Job, ex: Executor) -> None:
        assert isinstance(ex, InPlaceExecutor)
        self.result.violations += self._restarted(job, ex) + self._unfenced(job, ex)
        self.result.violations += _steps_twice(job.out)

    def _restarted(self, job: Job, ex: InPlaceExecutor) -> list[str]:
        """Workers that a node no fault touched stopped after the go before they trained to the
        end: they should have been kept.
        """
        go = (job.out / "go").stat().st_mtime
        touched = {f.target for f in self.s.faults if f.target >= 0} | ex.killed
        found = []
        for i in sorted(set(range(self.s.agents)) - touched):
            stopped = _events(self.root / f"logs{i}", "worker_stopped")
            lost = [e["pid"] for e in stopped if e["time"] > go]
            lost = [pid for pid in lost if not (job.out / f"done_{pid}.json").exists()]
            if lost:
                found.append(f"agent{i}, touched by no fault, stopped its workers {lost}")
        return found

    def _unfenced(self, job: Job, ex: InPlaceExecutor) -> list[str]:
        """An agent frozen past the TTL handed no later round to the workers it had (S4)."""
        found = []
        starts = job.starts()
        for i, kind, stopped, thawed in ex.long_stops:
            if thawed is None or thawed - stopped < TTL + 0.4:
                continue  # thawed early by an overlapping stop's end: its lease may hold
            agent = job.agents[i].pid
            had = {s.pid for s in starts if s.ppid == agent and s.t < stopped}
            grace = RESUME_WINDOW if kind.startswith("node") else 0.0
            late = [s for s in starts if s.pid in had and s.t > thawed + grace]
            found += [
                f"agent{i} frozen past its TTL ({kind}): its worker pid {s.pid} entered round"
                f" {s.round} as RANK {s.rank} after the thaw (+{s.t - thawed:.2f} s)"
                for s in late
            ]
        return found


def _steps_twice(out: Path) -> list[str]:
    found = []
    for path in out.glob("steps_*.jsonl"):
        steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line]
        twice = sorted({a for a, b in zip(steps, steps[1:], strict=False) if b <= a})
        if twice:
            found.append(f"worker {path.stem[6:]} computed steps again after {twice}")
    return found


def _events(logs: Path, name: str) -> list[dict]:
    with contextlib.suppress(OSError):
        lines = (logs / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e.get("event") == name]
    return []


def trial(schedule: Schedule, etcd_bin: str, root: Path) -> Trial:
    """The trial that carries out ``schedule``: in place or restarting, as its seed chose."""
    cls = InPlaceTrial if schedule.in_place else Trial
    return cls(schedule, etcd_bin, root)


__all__ = ["HeldSampler", "InPlaceExecutor", "InPlaceTrial", "held", "trial"]
