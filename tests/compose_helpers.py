"""Helpers for tests that run deploy/docker-compose.yml for real: one compose project per test.

Why compose through its CLI and containers through testcontainers' Docker client, not
testcontainers' ``DockerCompose``: DockerCompose 4.15 always runs ``<binary> compose`` and needs
``up --wait`` and ``ps --format json``, which exist only in compose v2; Debian ships v1 (1.29)
and no v2 plugin installs here. So ``up``/``down`` go through whichever compose CLI exists (v2
first), exactly as a user types them, and kill/pause/disconnect/inspect/logs go through
``testcontainers.core.docker_client.DockerClient`` (docker-py underneath).

Why read worker ranks from the host's /proc: containers share the host's kernel, so a
container's processes are host processes. A container's cgroup (named by its init's
/proc/<pid>/cgroup) lists every process in it — whatever its parentage, frozen or not — and
/proc/<pid>/environ holds the environment each worker was started with (RANK, ETCDRUN_ROUND,
WORLD_SIZE). Needs root, as Docker does here. A frozen (paused) worker counts as alive: it runs
again the moment its container is unpaused.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rank_sampler import alive

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"
BUILD = ROOT / "deploy" / "images" / "build.py"
LEASE_TTL = 5  # the compose file's default lease_ttl; the tests run it as users do


def compose_command() -> list[str] | None:
    """``docker compose`` (v2) where the plugin exists, else ``docker-compose`` (v1)."""
    if shutil.which("docker"):
        v2 = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if v2.returncode == 0:
            return ["docker", "compose"]
    exe = shutil.which("docker-compose")
    return [exe] if exe else None


def docker_problem() -> str | None:
    """Why the compose tests cannot run here, or None."""
    if shutil.which("docker") is None:
        return "no docker CLI (apt-get install docker.io)"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        return "no Docker engine answers `docker info` (start dockerd)"
    if compose_command() is None:
        return "no compose CLI (apt-get install docker-compose)"
    if os.geteuid() != 0:
        return "reading containers' processes from /proc needs root"
    return None


def build_images() -> dict[str, str]:
    """deploy/images/build.py, as a user runs it; its content-keyed tags.

    Why under a lock: build.py skips a tag that exists, but two builds of the same tag at once
    (pytest-xdist workers, two sessions on one machine) would both build it; the second one
    waits here and then finds the tags built.
    """
    lock = Path(tempfile.gettempdir()) / "etcdrun-compose-build.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file is closed
        proc = subprocess.run(
            [sys.executable, str(BUILD), "--json"], capture_output=True, text=True, timeout=900
        )
    assert proc.returncode == 0, f"build.py failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)


@dataclass(frozen=True)
class Worker:
    container: str  # compose container name
    pid: int  # host pid
    rank: int
    round: int
    world_size: int
    frozen: bool = False  # its container is frozen (docker pause): it runs no instruction


@dataclass
class Sample:
    t: float  # time.monotonic()
    workers: list[Worker]

    def ranks(self) -> dict[int, list[Worker]]:
        """The workers able to act, by RANK: a frozen process sends nothing and answers nothing,
        so it holds its RANK no more than a dead one (S4 is about two processes *acting* as one
        rank; the thaw is judged by how fast the warden then kills them).
        """
        out: dict[int, list[Worker]] = {}
        for w in self.workers:
            if not w.frozen:
                out.setdefault(w.rank, []).append(w)
        return out


def _cgroup_procs_file(init_pid: int) -> Path:
    """The cgroup.procs file of the cgroup ``init_pid`` is in (v1 pids controller, else v2)."""
    lines = Path(f"/proc/{init_pid}/cgroup").read_text().splitlines()
    by_ctl = {}
    for line in lines:
        _, ctls, path = line.split(":", 2)
        for c in ctls.split(",") if ctls else [""]:
            by_ctl[c] = path
    if "pids" in by_ctl and Path("/sys/fs/cgroup/pids").is_dir():
        return Path("/sys/fs/cgroup/pids" + by_ctl["pids"]) / "cgroup.procs"
    v2 = Path("/sys/fs/cgroup/unified")
    base = v2 if v2.is_dir() else Path("/sys/fs/cgroup")
    return Path(str(base) + by_ctl[""]) / "cgroup.procs"


def is_frozen(procs_file: Path) -> bool:
    """Whether the cgroup of ``procs_file`` (from _cgroup_procs_file) is frozen by the freezer
    (docker pause): v1 freezer.state of the same path, else v2 cgroup.events.
    """
    parts = procs_file.parent.parts
    if "pids" in parts:
        rel = Path(*parts[parts.index("pids") + 1 :])
        state = Path("/sys/fs/cgroup/freezer") / rel / "freezer.state"
        try:
            return state.read_text().strip() != "THAWED"
        except OSError:
            return False
    try:
        return "frozen 1" in (procs_file.parent / "cgroup.events").read_text()
    except OSError:
        return False


def _worker(container: str, pid: int, frozen: bool = False) -> Worker | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None  # gone
    env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
    if "RANK" not in env or "ETCDRUN_ROUND" not in env:
        return None  # docker-init, the agent itself, or a zombie (its environ is empty)
    rank, rnd, world = int(env["RANK"]), int(env["ETCDRUN_ROUND"]), int(env["WORLD_SIZE"])
    return Worker(container, pid, rank, rnd, world, frozen)


class RankSampler:
    """A thread that lists every agent container's live workers every ``interval`` seconds."""

    def __init__(self, procs_files: dict[str, Path], interval: float = 0.05) -> None:
        self.procs_files = procs_files
        self.interval = interval
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-sampler", daemon=True)

    def __enter__(self) -> RankSampler:
        self._thread.start()
        wait_for(lambda: self.samples, 10, "a first sample")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def take(self) -> Sample:
        found = []
        for name, procs in self.procs_files.items():
            try:
                pids = [int(p) for p in procs.read_text().split()]
            except OSError:
                continue  # the container is gone (killed): so is its cgroup
            frozen = is_frozen(procs)
            found += [w for pid in pids if (w := _worker(name, pid, frozen)) is not None]
        # One pass reads the containers one after another, so it is no snapshot: a worker read
        # early may be gone before a later one starts. Kept are those still there at the end —
        # alive at their own read and now, so all alive together at the last read.
        return Sample(time.monotonic(), [w for w in found if alive(w.pid)])

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.take())
            self._stop.wait(self.interval)

    @property
    def last(self) -> Sample:
        return self.samples[-1]

    def wait(self, predicate: Callable[[Sample], bool], timeout: float, what: str) -> Sample:
        """The first sample (taken from now on) that satisfies ``predicate``."""
        start = len(self.samples)

        def found() -> Sample | None:
            return next((s for s in self.samples[start:] if predicate(s)), None)

        return wait_for(found, timeout, f"{what} (last sample: {describe(self.last)})")

    def duplicates(self) -> list[tuple[float, int, list[Worker]]]:
        """(time, RANK, workers) for each sample where two unfrozen live workers held one RANK."""
        return [
            (s.t, rank, ws) for s in self.samples for rank, ws in s.ranks().items() if len(ws) > 1
        ]


def describe(s: Sample) -> str:
    """'agent 1: r0@1 r1@1, ...' (RANK@round per container; v1 and v2 container names)."""
    by: dict[str, list[str]] = {}
    for w in sorted(s.workers, key=lambda w: w.rank):
        number = re.split(r"[-_]", w.container)[-1]
        by.setdefault(number, []).append(f"r{w.rank}@{w.round}")
    return ", ".join(f"agent {k}: {' '.join(v)}" for k, v in sorted(by.items())) or "no workers"


def full_round(world: int, after: int = 0) -> Callable[[Sample], bool]:
    """A sample where exactly ``world`` workers run one round > ``after`` with that world."""

    def ok(s: Sample) -> bool:
        rounds = {w.round for w in s.workers}
        return (
            len(s.workers) == world
            and len(rounds) == 1
            and min(rounds) > after
            and sorted(w.rank for w in s.workers) == list(range(world))
            and all(w.world_size == world for w in s.workers)
        )

    return ok


@dataclass
class Cluster:
    """One compose project: 3 etcd members and ``agents`` agents; ``down()`` checks it is gone."""

    images: dict[str, str]
    agents: int = 3
    project: str = field(default_factory=lambda: "etcdrun-t" + uuid.uuid4().hex[:8])
    _rule: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        from testcontainers.core.docker_client import DockerClient

        self.docker = DockerClient().client  # docker-py, through testcontainers
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("ETCDRUN_", "COMPOSE_"))},
            "ETCDRUN_ETCD_IMAGE": self.images["etcd"],
            "ETCDRUN_AGENT_IMAGE": self.images["agent"],
            "ETCDRUN_JOB": self.project,
            "ETCDRUN_LOGLEVEL": "DEBUG",  # the agents' JSON event lines, for the checker
            "ETCDRUN_STEPS": "100000",
        }

    def compose(self, *args: str, timeout: float = 180) -> str:
        cmd = [*compose_command(), "-p", self.project, "-f", str(COMPOSE_FILE), *args]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
        return proc.stdout

    def up(self) -> None:
        try:
            # Created, then opened, then started: the members must reach each other from the start.
            self.compose("up", "--no-start", "--scale", f"agent={self.agents}")
            self._open_bridge()
            self.compose("up", "-d", "--scale", f"agent={self.agents}")
        except AssertionError as err:  # compose says only "unhealthy": say what etcd said
            raise AssertionError(f"{err}\n{self.diagnose()}") from None

    def _open_bridge(self) -> None:
        """Accept forwarding within this project's bridge, for the test's lifetime.

        Why: with br_netfilter on (bridge-nf-call-iptables=1, as here), traffic between two
        containers on one bridge crosses the host's FORWARD chain. Once any dockerd ran with its
        iptables rules, or ufw/firewalld is on, that chain's policy is DROP; CI's dockerd runs
        --iptables=false and adds no ACCEPT of its own, so the members never hear each other's
        votes and stay unhealthy (CI, 2026-12-01: "failed to commit proposal"). One rule, named by
        the project, removed by down() and checked by leftovers().
        """
        if shutil.which("iptables") is None:
            return
        net = self.docker.networks.get(self.network)
        bridge = net.attrs["Options"].get("com.docker.network.bridge.name") or f"br-{net.id[:12]}"
        rule = ["FORWARD", "-i", bridge, "-o", bridge, "-m", "comment", "--comment", self.project]
        _iptables("-I", *rule, "-j", "ACCEPT")
        self._rule = [*rule, "-j", "ACCEPT"]

    def diagnose(self) -> str:
        """Each etcd member's state, last health checks and last log lines: what `up` hides."""
        out = []
        for service in ("etcd1", "etcd2", "etcd3"):
            for c in self.containers(service):
                state = c.attrs["State"]
                out.append(f"--- {c.name}: {state.get('Status')} exit {state.get('ExitCode')}")
                for check in (state.get("Health") or {}).get("Log", [])[-3:]:
                    said = check.get("Output", "").strip().replace("\n", " | ")
                    out.append(
                        f"  health {check.get('Start', '')[:23]} rc {check.get('ExitCode')}: {said}"
                    )
                logs = c.logs(tail=15).decode(errors="replace").rstrip()
                out.extend(f"  log: {line}" for line in logs.splitlines())
        return "\n".join(out)

    def containers(self, service: str, all: bool = True) -> list[Any]:
        labels = [f"com.docker.compose.project={self.project}"]
        labels.append(f"com.docker.compose.service={service}")
        found = self.docker.containers.list(all=all, filters={"label": labels})
        return sorted(found, key=lambda c: c.name)

    def procs_files(self) -> dict[str, Path]:
        return {
            c.name: _cgroup_procs_file(c.attrs["State"]["Pid"]) for c in self.containers("agent")
        }

    @property
    def network(self) -> str:
        return f"{self.project}_default"

    def endpoints(self) -> str:
        """The running members' client ports as published on 127.0.0.1 (the host side)."""
        eps = []
        for c in self.containers("etcd1") + self.containers("etcd2") + self.containers("etcd3"):
            bindings = c.attrs["NetworkSettings"]["Ports"].get("2379/tcp")
            if c.status == "running" and bindings:
                eps.append(f"127.0.0.1:{bindings[0]['HostPort']}")
        return ",".join(eps)

    def events(self) -> list[dict[str, Any]]:
        """Every etcdrun event the agents logged (LOGLEVEL=DEBUG), from their containers' logs."""
        out = []
        for c in self.containers("agent"):
            for line in c.logs(stdout=False, stderr=True).decode(errors="replace").splitlines():
                i = line.find('{"')
                if i >= 0 and '"event"' in line:
                    try:
                        ev = json.loads(line[i:])
                    except ValueError:
                        continue
                    ev["container"] = c.name
                    out.append(ev)
        return out

    def container_of_node_rank(self, node_rank: int, round_number: int) -> Any:
        for ev in self.events():
            if (
                ev["event"] == "round_accepted"
                and ev["round"] == round_number
                and ev["node_rank"] == node_rank
            ):
                return self.docker.containers.get(ev["container"])
        raise AssertionError(f"no agent accepted round {round_number} as node rank {node_rank}")

    def leftovers(self) -> list[str]:
        label = {"label": [f"com.docker.compose.project={self.project}"]}
        left = [f"container {c.name}" for c in self.docker.containers.list(all=True, filters=label)]
        left += [f"network {n.name}" for n in self.docker.networks.list(filters=label)]
        left += [f"volume {v.name}" for v in self.docker.volumes.list(filters=label)]
        left += [f"network {n.name}" for n in self.docker.networks.list(names=[self.network])]
        if shutil.which("iptables"):
            rules = _iptables("-S", "FORWARD").splitlines()
            left += [f"iptables rule {r}" for r in rules if self.project in r]
        return left

    def down(self) -> None:
        for c in self.containers("agent"):
            if c.status == "paused":
                c.unpause()  # a frozen container cannot be stopped
        # -t 3: an agent leaves in ~0.3 s (SIGTERM, exit 143); the etcd member stopped last has
        # no quorum left and would spend ~10 s in its graceful stop for nothing.
        self.compose("down", "-v", "--remove-orphans", "-t", "3")
        if self._rule:
            _iptables("-D", *self._rule)
            self._rule = []
        left = self.leftovers()
        self.docker.close()
        assert not left, f"compose down left {left}"


def _iptables(*args: str) -> str:
    res = subprocess.run(["iptables", *args], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"iptables {' '.join(args)}: {res.stderr.strip()}"
    return res.stdout
