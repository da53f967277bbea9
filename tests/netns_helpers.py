"""Several hosts on one machine: Linux network namespaces joined by veth pairs and a bridge.

Why namespaces and not containers: no image, no daemon, and the whole network is up in ~0.2 s,
so every CI run can afford a real multi-host test — real TCP over real interfaces, each host with
its own address, and links that can be cut (``tc netem`` has no kernel module here; ``ip link set
down`` does). Measured here: a hub and four hosts built in 0.18 s, etcd inside one ready 0.34 s
later, everything gone 0.03 s after the end.

Topology: a ``hub`` namespace holds a bridge and, per host, the hub end ``v<tag6><host>`` of a
veth pair; the host's namespace holds the other end as ``eth0`` (10.91.0.<i>/24) and ``lo``.
Nothing is created in the machine's own namespace, so addresses can never clash with its network
or with another test's: each Net is a world of its own. Only namespace names are global, so they
carry a tag unique to the Net, and a Net deletes only the namespaces it created itself.

Cutting a host: its hub end goes down. The host's ``eth0`` loses carrier but keeps its address and
route, so its packets vanish silently — a partition, not a refused connection.

Lifecycle: ``with Net([...]) as net:`` builds everything or nothing, and on exit (failure
included) kills any process still inside its namespaces (reported: that is a leak), deletes them,
and checks that none of its namespaces or links is left. Inside it: ``NetnsEtcd`` (one etcd
member on a host's address) and ``NetnsJob`` (agent_helpers.Job with each agent on a host).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import WORKER, Agent, Job, Start, clean_env
from etcd_helpers import pid_alive

NS_PREFIX = "etcdrun-t"  # every namespace a Net creates: etcdrun-t<tag>-<host>
SUBNET = "10.91.0"
EXIT_GRACE = 5.0  # s for what was inside to end by itself before close() calls it a leak
PROBE = str(Path(__file__).parent / "agent_scripts" / "netns_probe.py")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


def _namespaces() -> set[str]:
    out = _ip("-json", "netns", "list").stdout.strip()
    return {entry["name"] for entry in json.loads(out or "[]")}


def require_netns() -> None:
    """Skip when namespaces cannot be made (not root, no ``ip``); FAIL instead when CI=true."""
    reason = None
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    elif shutil.which("ip") is None:
        reason = "`ip` not found (apt-get install iproute2)"
    else:
        probe = f"{NS_PREFIX}{uuid.uuid4().hex[:6]}-probe"
        res = _ip("netns", "add", probe, check=False)
        if res.returncode != 0:
            reason = f"`ip netns add` failed: {res.stderr.strip()}"
        else:
            _ip("netns", "del", probe)
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"{reason} [CI=true: the multi-host tests must run]", pytrace=False)
    pytest.skip(reason)


def print_figures(capsys: pytest.CaptureFixture[str], tag: str, what: str, **secs: float) -> None:
    """One line of measured figures in the test run's output, past pytest's capture: CI logs
    then carry them (fence time vs TTL, recovery times) on every run.
    """
    shown = ", ".join(f"{k} {v:.2f} s" for k, v in secs.items())
    with capsys.disabled():
        print(f"\n[{tag}] {what}: {shown}")


class Net:
    """A hub namespace with a bridge, and one namespace per host plugged into it."""

    def __init__(self, hosts: Sequence[str], tag: str | None = None) -> None:
        if len(set(hosts)) != len(hosts) or "hub" in hosts or any(len(h) > 8 for h in hosts):
            raise ValueError(f"host names must be unique, not 'hub', <= 8 characters: {hosts}")
        self.hosts = list(hosts)
        self.tag = tag or uuid.uuid4().hex[:8]
        self._short = self.tag[:6]  # in every link name (15 characters at most)
        self._created: list[str] = []  # namespaces this Net made, and only those, are deleted

    def ns(self, host: str) -> str:
        return f"{NS_PREFIX}{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(host) + 1}"

    def veth(self, host: str) -> str:
        """The hub end of ``host``'s cable (the one ``cut`` unplugs)."""
        return f"v{self._short}{host}"

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace (``ip netns exec`` execs: same pid)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    # ---- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> Net:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        if name in _namespaces():
            raise RuntimeError(f"namespace {name} already exists: not ours, left alone")
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        hub = self.ns("hub")
        self._add_ns(hub)
        bridge = f"br{self._short}"
        _ip("-n", hub, "link", "add", bridge, "type", "bridge")
        _ip("-n", hub, "link", "set", bridge, "up")
        for host in self.hosts:
            ns = self.ns(host)
            self._add_ns(ns)
            veth = self.veth(host)
            _ip("-n", hub, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", veth, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def close(self) -> None:
        """Kill what is still inside, delete our namespaces, and fail if anything is left."""
        problems = []
        inside = {
            n: [int(p) for p in _ip("netns", "pids", n, check=False).stdout.split()]
            for n in self._created
        }
        # What ends by itself gets a moment: a warden sweeps its node's tag once more after its
        # agent died, a standby's parent-death signal is asynchronous (CI, under load: a
        # process seen just before it went). A leak is what is still there after it.
        deadline = time.monotonic() + EXIT_GRACE
        while time.monotonic() < deadline and any(map(pid_alive, sum(inside.values(), []))):
            time.sleep(0.02)
        for name in self._created:
            pids = inside[name]
            running = [_described(p) for p in pids if pid_alive(p)]  # not those exiting
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if running:
                problems.append(f"processes {running} were still running in {name} (killed)")
            _ip("netns", "del", name, check=False)
        left = _namespaces() & set(self._created)
        if left:
            problems.append(f"namespaces left: {sorted(left)}")
        # Our links live in our namespaces and die with them; one in the root namespace (by its
        # tag) would be a bug of this helper's.
        links = [n["ifname"] for n in json.loads(_ip("-json", "link", "show").stdout or "[]")]
        stray = [n for n in links if self._short in n]
        if stray:
            problems.append(f"links tagged {self._short} in the root namespace: {stray}")
        self._created = [n for n in self._created if n in left]
        if problems:
            raise AssertionError("netns sweep: " + "; ".join(problems))

    # ---- faults -----------------------------------------------------------------------------
    def cut(self, host: str) -> float:
        """Unplug ``host`` from the bridge; the wall time just after the link went down (wall, as
        in the workers' records and the agents' events: one machine, one clock).
        """
        _ip("-n", self.ns("hub"), "link", "set", self.veth(host), "down")
        return time.time()

    def restore(self, host: str) -> float:
        _ip("-n", self.ns("hub"), "link", "set", self.veth(host), "up")
        return time.time()

    # ---- looking at etcd from inside --------------------------------------------------------
    def probe(self, host: str, *args: str, stdin: str = "", timeout: float = 30.0) -> object:
        """Run tests/agent_scripts/netns_probe.py in ``host``'s namespace; its JSON answer.

        Why a process: the test process lives in the root namespace and cannot reach any host;
        a probe inside the etcd host's namespace reaches etcd even while its link is cut.
        """
        argv = self.exec_argv(host, [sys.executable, PROBE, *args])
        # A probe that hangs dumps its threads' stacks and exits before we give up on it (CI,
        # once: two `check` probes took over 30 s, against 0.4-4 s here, loaded or not).
        env = {**os.environ, "PROBE_STACKS_AFTER": str(max(1.0, timeout - 3))}
        try:
            res = subprocess.run(
                argv, input=stdin, capture_output=True, text=True, timeout=timeout, env=env
            )
        except subprocess.TimeoutExpired as e:
            err = e.stderr or b""  # what the probe wrote before the timeout: bytes, even here
            text = err if isinstance(err, str) else err.decode(errors="replace")
            msg = f"probe {args} in {host}: no answer in {timeout} s: {text}"
            raise AssertionError(msg) from None
        if res.returncode != 0:
            raise AssertionError(f"probe {args} in {host} failed: {res.stderr[-4000:]}")
        return json.loads(res.stdout)


class NetnsEtcd:
    """One etcd member in a host namespace, serving clients on the host's address.

    Why not LocalEtcd: its members bind 127.0.0.1 and are probed from the test process; here the
    member must listen on the namespace's address and can only be probed from inside. Same fast
    raft timings as LocalEtcd (heartbeat 10 ms, election 100 ms), so lease TTLs of 2 s hold.
    """

    def __init__(self, net: Net, host: str, etcd_bin: str, root: Path) -> None:
        self.net, self.host, self.etcd_bin = net, host, etcd_bin
        self.data_dir = root / f"etcd-{net.tag}"
        self.log_path = root / f"etcd-{net.tag}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.net.addr(self.host)}:2379"

    def start(self, timeout: float = 10.0) -> NetnsEtcd:
        client = f"http://{self.endpoint}"
        peer = "http://127.0.0.1:2380"  # a single member: its peer URL stays inside its host
        argv = [
            self.etcd_bin,
            *("--name", "m0", "--data-dir", str(self.data_dir)),
            *("--listen-client-urls", client, "--advertise-client-urls", client),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"m0={peer}", "--initial-cluster-state", "new"),
            *("--heartbeat-interval", "10", "--election-timeout", "100", "--logger", "zap"),
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.net.exec_argv(self.host, argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        try:
            self.net.probe(self.host, "ready", self.endpoint, str(timeout), timeout=timeout + 5)
        except AssertionError as e:
            self.stop()
            raise AssertionError(f"{e}\netcd's log:\n{self.log_tail()}") from None
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> NetnsEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class NetnsJob(Job):
    """A Job whose agents each run in one host's namespace, reachable at that host's address.

    Agents log at DEBUG so that their ``etcdrun.events`` lines (JSON, on stderr) can be read back:
    the checker needs every ``round_accepted``, and the figures need the times of the others.
    """

    def __init__(self, net: Net, endpoints: str, root: Path, **kw: Any) -> None:
        super().__init__(endpoints, root, **kw)
        self.net = net
        self.on: dict[str, Agent] = {}  # host -> its latest agent

    def start_on(self, host: str, *script: str, env: dict[str, str] | None = None) -> Agent:
        """One more agent, in ``host``'s namespace; ``script`` defaults to worker.py (sleep)."""
        script = script or self.script or (WORKER, str(self.out), "sleep")
        # --log-dir: the agent's default is a fresh /tmp/etcdrun_logs_* it never removes.
        logs = str(self.root / "logs")
        argv = [*self.argv(), "--local-addr", self.net.addr(host), "--log-dir", logs, *script]
        agent = Agent(
            self.net.exec_argv(host, argv),
            self.root,
            f"{host}-{len(self.agents)}",
            env or clean_env(LOGLEVEL="DEBUG"),
        )
        self.agents.append(agent)
        self.on[host] = agent
        return agent

    def host_of(self, start: Start) -> str:
        """The host whose agent started this worker (agents are named ``<host>-<n>``)."""
        return self.agent_of(start).name.rsplit("-", 1)[0]

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """Every event the agents logged (``name``: only those), in time order."""
        found = []
        for agent in self.agents:
            for line in agent.stderr.splitlines():
                at = line.find('{"')
                if at >= 0 and '"event": ' in line:
                    event = json.loads(line[at:])
                    event["agent"] = agent.name
                    found.append(event)
        return sorted((e for e in found if name in (None, e["event"])), key=lambda e: e["time"])

    def violations(self, etcd: NetnsEtcd, lo: int, hi: int) -> list[str]:
        """The rendezvous checker over etcd's history and every agent's round_accepted."""
        accepted = json.dumps(self.events("round_accepted"))
        # 60 s, twice the default: see probe() for why, and for what a hang still shows.
        argv = ("check", etcd.endpoint, self.run_id, str(lo), str(hi))
        found = self.net.probe(etcd.host, *argv, stdin=accepted, timeout=60.0)
        assert isinstance(found, list)
        return found


def _described(pid: int) -> str:
    """'<pid> (<command line>)': what was left behind, for the message."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return str(pid)
    return f"{pid} ({' '.join(a.decode(errors='replace') for a in argv if a)[:120]})"
