"""Reading examples/ddp_elastic.py's runs: its rank-0 lines, its checkpoints, its sockets.

Why from the lines and the files and not from a hook in the script: the example must stay a
plain user script. Rank 0 prints ``ddp_elastic resume|step|checkpoint|done k=v ...``; one
*segment* is what one rank-0 process printed, from its ``resume`` line on. Lines of a rank 0
whose agent was killed may be lost with the agent's pipe, so which checkpoint a restart had to
resume from is read from the checkpoint files (CheckpointLog: each one's first mtime, watched
while the run goes on), not from the lines alone.
"""

from __future__ import annotations

import math
import os
import re
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agent_helpers import clean_env

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "ddp_elastic.py")
# "ddp_elastic step=<s> world=<W> loss=<l>" or "ddp_elastic resume|checkpoint|done k=v ...",
# after etcdrun's "[<rank>]:" prefix (torchrun prints none).
LINE = re.compile(
    r"^(?:\[\d+\]:)?ddp_elastic (?:(resume|regroup|checkpoint|done) )?(.*)$", re.MULTILINE
)
CKPT = re.compile(r"^ckpt_(\d{8})\.pt$")
# Rounding is all that may differ between world sizes (the gradients are summed in another
# order); measured against world size 1: at most 7.2e-7 relative over 100 steps at 2, 3 and 4.
RTOL = 1e-4


@dataclass
class Segment:
    """What one rank-0 process printed, in order."""

    source: str
    resume: int
    world: int
    restart: int
    master: str
    t: float
    steps: list[tuple[int, int, float]] = field(default_factory=list)  # (step, world, loss)
    checkpoints: list[int] = field(default_factory=list)
    done: bool = False
    t_done: float = 0.0
    in_place: bool = False  # a regroup (--in-place): the same process went on from a commit

    @property
    def step_numbers(self) -> list[int]:
        return [s for s, _, _ in self.steps]


def _fields(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in text.split())


def segments(outputs: dict[str, str]) -> list[Segment]:
    """Every rank-0 process's lines, from the outputs of agents (or launchers) by name, in the
    order the processes resumed.
    """
    found: list[Segment] = []
    for source, text in outputs.items():
        current: Segment | None = None
        for kind, rest in LINE.findall(text):
            f = _fields(rest)
            if kind == "resume":
                current = Segment(
                    source,
                    int(f["step"]),
                    int(f["world"]),
                    int(f["restart"]),
                    f["master"],
                    float(f["t"]),
                )
                found.append(current)
            elif current is None:
                raise AssertionError(f"{source}: a '{kind}' line before any resume line")
            elif kind == "regroup":
                step, world, t = int(f["step"]), int(f["world"]), float(f["t"])
                current = Segment(source, step, world, current.restart, "", t, in_place=True)
                found.append(current)
            elif not kind:
                current.steps.append((int(f["step"]), int(f["world"]), float(f["loss"])))
            elif kind == "checkpoint":
                current.checkpoints.append(int(f["step"]))
            else:
                current.done, current.t_done = True, float(f["t"])
    return sorted(found, key=lambda s: s.t)


def checkpoint_files(directory: Path) -> dict[int, os.stat_result]:
    """Whole checkpoints by step (a ``.tmp`` is none)."""
    found = {}
    for path in directory.iterdir() if directory.exists() else ():
        m = CKPT.match(path.name)
        if m:
            try:
                found[int(m.group(1))] = path.stat()
            except FileNotFoundError:  # pruned (--keep) between the listing and the stat
                continue
    return found


class CheckpointLog:
    """Every checkpoint file seen while a run goes on, with its first version's mtime, and the
    steps whose file was written again.

    Why watch rather than look once at the end: a run that resumed from a too-old checkpoint
    writes the newer ones again, and the end state alone would hide it. In an exact run each
    checkpoint is written once (a restart repeats only steps after the newest one), so a file
    that changes is a failure. The tests poll it with every wait (every 20 ms); a restart takes
    seconds, so no rewrite can fall between two polls.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.first: dict[int, tuple[int, int]] = {}  # step -> (inode, mtime_ns)
        self.rewritten: set[int] = set()

    def poll(self) -> None:
        for step, st in checkpoint_files(self.directory).items():
            version = (st.st_ino, st.st_mtime_ns)
            if self.first.setdefault(step, version) != version:
                self.rewritten.add(step)

    def written_before(self, t: float) -> list[int]:
        return [step for step, (_, ns) in self.first.items() if ns / 1e9 < t]


@dataclass
class Reference:
    """A one-process run (world size 1, every checkpoint kept): the loss of every step, the
    curve every elastic run must follow whatever its world sizes and restarts.
    """

    losses: dict[int, float]
    ckpt_dir: Path


def reference_run(root: Path, steps: int, args: tuple[str, ...]) -> Reference:
    """Run the example in one process, given torchrun's environment by hand."""
    from etcdrun.rendezvous.free_port import reserve_free_port

    env = clean_env(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(reserve_free_port()),
        OMP_NUM_THREADS="1",
    )
    ckpt = root / "ckpt"
    argv = [sys.executable, EXAMPLE, "--steps", str(steps), "--checkpoint-dir", str(ckpt), *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    (seg,) = segments({"reference": done.stdout})
    assert seg.done and seg.step_numbers == list(range(1, steps + 1)), done.stdout[-2000:]
    return Reference({s: loss for s, _, loss in seg.steps}, ckpt)


@dataclass
class Verdict:
    """What check_exact found, for the test's figures."""

    resumed_from: list[int]
    repeated: int
    first_loss: float
    last_loss: float
    max_rel_diff: float  # the largest |loss - one-process loss| / loss over every printed step


def _check_segment(seg: Segment, reference: dict[int, float]) -> float:
    expected = list(range(seg.resume + 1, seg.resume + 1 + len(seg.steps)))
    assert seg.step_numbers == expected, f"{seg.source}: steps {seg.step_numbers} != {expected}"
    assert {w for _, w, _ in seg.steps} <= {seg.world}, seg
    worst = 0.0
    for step, _, loss in seg.steps:
        want = reference[step]
        assert math.isclose(loss, want, rel_tol=RTOL), (
            f"{seg.source}: step {step} (world {seg.world}, resumed from {seg.resume}) "
            f"loss {loss!r} != the one-process run's {want!r}"
        )
        worst = max(worst, abs(loss - want) / abs(want))
    return worst


def check_exact(
    segs: list[Segment], reference: dict[int, float], log: CheckpointLog, steps: int, *, done: bool
) -> Verdict:
    """The run's exactness: every process resumed from the newest checkpoint written before it
    started (no step lost, none repeated beyond it), wrote no checkpoint twice, and went on one
    step at a time from there; every step's loss is the one-process run's (so the restored state
    and the data were exact); the loss went down; with ``done`` the last process finished at
    exactly ``steps``.
    """
    assert segs, "no rank-0 output at all"
    log.poll()
    assert not log.rewritten, f"checkpoints written twice: steps {sorted(log.rewritten)}"
    worst, printed_ckpt = 0.0, 0
    for seg in segs:
        worst = max(worst, _check_segment(seg, reference))
        if seg.in_place:  # went on from its last commit, not from a checkpoint
            continue
        newest = max(log.written_before(seg.t), default=0)
        assert seg.resume == newest, (
            f"{seg.source} resumed from step {seg.resume} at t={seg.t:.3f}, but the newest "
            f"checkpoint then was step {newest} (seen: {sorted(log.first)})"
        )
        assert seg.resume >= printed_ckpt, f"{seg.source}: a checkpoint of {printed_ckpt} printed"
        assert set(seg.checkpoints) <= set(log.first), (seg.checkpoints, sorted(log.first))
        printed_ckpt = max([printed_ckpt, *seg.checkpoints])
    printed = sorted({s for seg in segs for s in seg.step_numbers})
    last = segs[-1]
    if done:
        assert last.done and last.step_numbers[-1:] == [steps], f"the last process: {last}"
        assert [seg.done for seg in segs].count(True) == 1, "done more than once"
        assert printed == list(range(segs[0].resume + 1, steps + 1)), f"steps: {printed}"
    else:
        assert not any(seg.done for seg in segs), "a failed run printed done"
    loss = {s: value for seg in segs for s, _, value in seg.steps}  # the last run of each step
    curve = [loss[s] for s in printed]
    first, final = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert final < 0.5 * first, f"the loss did not go down: {first:.4f} -> {final:.4f}"
    repeated = sum(len(seg.steps) for seg in segs) - len(printed)
    return Verdict([seg.resume for seg in segs], repeated, curve[0], curve[-1], worst)


# ---- what a worker's sockets are bound and connected to ------------------------------------------
def _ipv4(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    if len(ip) == 32:  # IPv6 row: keep only v4-mapped addresses (::ffff:a.b.c.d) and ::
        if ip == "0" * 32:
            return "0.0.0.0", int(port, 16)
        if ip[:24] != "0000000000000000FFFF0000":
            return "?", int(port, 16)
        ip = ip[24:]
    return socket.inet_ntoa(struct.pack("<I", int(ip, 16))), int(port, 16)


def tcp_sockets(pid: int) -> list[tuple[tuple[str, int], tuple[str, int], str]]:
    """(local, remote, "listen"|"established"|other) of every TCP socket ``pid`` holds, from
    /proc: the kernel's view, whatever the process thinks it asked for.
    """
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    states = {"0A": "listen", "01": "established"}
    found = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = row.split()
            if cols[9] in inodes:
                found.append((_ipv4(cols[1]), _ipv4(cols[2]), states.get(cols[3], cols[3])))
    return found


def worker_pids(agent_pid: int) -> list[int]:
    """The agent's children (its workers), from /proc."""
    kids: list[int] = []
    for task in Path(f"/proc/{agent_pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def worker_stacks(agent_pid: int, path: str, tail: int) -> dict[int, str]:
    """Each live worker's stacks (the last ``tail`` characters), or why there are none, as the
    hang watchdog's ``stacks.dump`` reads them from the faulthandler file ``path`` that the
    agent's workers were armed with (``stacks.env(path)``).
    """
    from etcdrun.agent.hang import stacks

    live = worker_pids(agent_pid)
    got = stacks.dump({pid: (pid, path) for pid in live}, 2.0)
    return {pid: s.text[-tail:] if isinstance(s, stacks.Stack) else s for pid, s in got.items()}


ABORT = "terminate called without an active exception"
ROUND_START = re.compile(r"^\[etcdrun [^\]]*\] round \d+: node rank ")
WORKER_LINE = re.compile(r"^\[(\d+)\]:(.*)$")


def aborts(stderr: str) -> list[tuple[int, bool]]:
    """(rank, had it raised first?) for every worker of an agent that aborted in C++ at exit
    ("terminate called without an active exception": torch 2.13 + gloo, issue 10 part 1).

    Why tell them apart: a worker that raised (a peer died under it, or it was made to fail)
    was failing anyway, and the abort only changes how it dies; a worker that aborts after
    finishing its work turns a success into a failure, which a test must never let pass.
    """
    raised: set[int] = set()
    found = []
    for line in stderr.splitlines():
        if ROUND_START.match(line):
            raised.clear()  # a new round: new worker processes
            continue
        m = WORKER_LINE.match(line)
        if m and "Traceback (most recent call last)" in m.group(2):
            raised.add(int(m.group(1)))
        elif m and ABORT in m.group(2):
            found.append((int(m.group(1)), int(m.group(1)) in raised))
    return found


NODE_RANK = re.compile(r"round (\d+): node rank (\d+) of (\d+)")


def node_ranks(stderr: str) -> dict[int, int]:
    """Round -> this agent's node rank, from its log lines."""
    return {int(r): int(n) for r, n, _ in NODE_RANK.findall(stderr)}
