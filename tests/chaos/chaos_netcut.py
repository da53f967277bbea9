"""A node's network cut for the chaos trials: every packet its processes send is dropped.

Why this way: the trials run etcd, agents and the history recorder on one loopback, and the
namespaces of tests/netns_helpers.py would put etcd out of the recorder's reach. A cgroup v2
group per node (the hybrid hierarchy's ``unified`` mount here) plus one iptables rule matching it
(``-m cgroup --path``) cuts exactly that node — agent, warden, workers, and whatever they start
later (children inherit the group) — while everyone else talks on. The node starts in its group:
a socket is matched by the group of the process that made it, so moving a running agent would
leave its etcd connections uncut (found the first time: a 3.2 s cut changed nothing). Dropped,
not refused: the node's requests and keep-alives vanish silently, as in a partition; etcd's
packets still arrive but nothing answers them. Measured here (seed 162, TTL 2): the cut node
paused its workers 1.5 s after its last acknowledged keep-alive and killed them at 2.0 s; the
others ran round 2 without it 0.5 s later and round 3 with it 1.1 s after the cut ended.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

UNIFIED = Path("/sys/fs/cgroup/unified")
PREFIX = "etcdrun-chaos-"


def _root() -> Path:
    """Where cgroup v2 is mounted: the hybrid ``unified`` mount, else the pure v2 root."""
    return UNIFIED if UNIFIED.is_dir() else Path("/sys/fs/cgroup")


def unavailable() -> str | None:
    """Why a cut cannot be made here (None: it can)."""
    if shutil.which("iptables") is None:
        return "no iptables"
    root = _root()
    if not (root / "cgroup.procs").exists():
        return f"no cgroup v2 hierarchy at {root}"
    probe = root / f"{PREFIX}probe"
    try:
        probe.mkdir(exist_ok=True)
        probe.rmdir()
    except OSError as e:
        return f"cannot make a cgroup under {root}: {e}"
    return None


class NetCut:
    """One node's group and cuts. A socket belongs to the group of the process that made it, so
    the node must *start* in its group: ``wrap`` prefixes its command (a shell that joins the
    group, then execs). ``start()`` drops what the node sends; ``end()`` lets it talk again once
    every cut begun has ended (a schedule may cut one node twice, overlapping); ``close()``
    ends them all and removes the group (moving anything still in it back to the root).
    """

    def __init__(self, name: str) -> None:
        self.name = PREFIX + name
        self.path = _root() / self.name
        self._rule = ["OUTPUT", "-m", "cgroup", "--path", self.name, "-j", "DROP"]
        self._depth = 0  # cuts begun and not ended
        self.path.mkdir(exist_ok=True)

    @property
    def wrap(self) -> tuple[str, ...]:
        return ("sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh")

    def start(self) -> None:
        if self._depth == 0:
            _iptables("-I", *self._rule)
        self._depth += 1

    def end(self) -> None:
        if self._depth == 1:
            _iptables("-D", *self._rule)
        self._depth = max(0, self._depth - 1)

    def close(self) -> None:
        self._depth = min(self._depth, 1)
        self.end()
        if not self.path.is_dir():
            return
        for pid in (self.path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (_root() / "cgroup.procs").write_text(pid)
        self.path.rmdir()


def leftovers(tag: str) -> list[str]:
    """Rules and groups of this trial still in place (each is a leak)."""
    found = [f"cgroup {p}" for p in _root().glob(f"{PREFIX}{tag}*")]
    rules = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True).stdout
    found += [f"iptables rule: {r}" for r in rules.splitlines() if f"{PREFIX}{tag}" in r]
    return found


def _iptables(*args: str) -> None:
    res = subprocess.run(["iptables", *args], capture_output=True, text=True, timeout=10)
    if res.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)}: {res.stderr.strip()}")
