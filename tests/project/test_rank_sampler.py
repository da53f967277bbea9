"""The /proc rank sampler must see a real overlap and must not invent one.

Why: one pass over /proc is no snapshot. A round change that stops RANK 0 of round 1 and then
starts RANK 0 of round 2 while the pass runs would show both (CI saw that once in a compose test:
one sample, span 0.00 s). A worker counts only if it is still alive after the pass.
"""

from __future__ import annotations

import subprocess
import sys

from rank_sampler import RankSampler, tagged_env


def _worker(env: dict[str, str], rank: int, rnd: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env={**env, "RANK": str(rank), "ETCDRUN_ROUND": str(rnd)},
    )


def test_two_live_workers_of_one_rank_are_an_overlap() -> None:
    tag, env = tagged_env()
    procs = [_worker(env, 0, 1), _worker(env, 0, 2)]
    try:
        rs = RankSampler(tag)
        rs.sample()
        assert len(rs.overlaps) == 1 and "RANK 0: rounds ['1', '2']" in rs.overlaps[0]
    finally:
        for p in procs:
            p.communicate(b"")


def test_a_worker_gone_before_the_pass_ends_is_no_overlap() -> None:
    tag, env = tagged_env()
    old, new = _worker(env, 0, 1), _worker(env, 0, 2)
    rs = RankSampler(tag)
    listed = list(rs._processes())
    assert {pid for pid, *_ in listed} == {old.pid, new.pid}
    old.communicate(b"")  # the old round's worker ends while the pass is under way ...
    rs._processes = lambda: iter(listed)  # ... after the pass had read it
    try:
        rs.sample()
        assert rs.overlaps == [] and rs.seen == {("0", "2")}
    finally:
        new.communicate(b"")


def test_a_killed_worker_is_not_alive_while_the_kernel_frees_its_memory() -> None:
    """After SIGKILL a big process shows state R for a while (its memory being freed) but runs
    none of its own code again: it holds no RANK (PF_EXITING; a torch worker takes ~0.1-0.2 s).
    It sleeps in input() until the kill (S).
    """
    import os
    import signal
    from pathlib import Path

    from rank_sampler import alive

    big = "b = bytearray(1 << 30); b[::4096] = b'x' * len(b[::4096]); print(flush=True); input()"
    p = subprocess.Popen([sys.executable, "-c", big], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        p.stdout.readline()  # 1 GiB touched
        assert alive(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        seen: list[tuple[str, bool]] = []
        while not seen or seen[-1][0] not in ("Z", "X"):
            try:
                state = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                state = "X"
            seen.append((state, alive(p.pid)))
        # Woken by the signal it shows R a moment before it starts to exit (CI saw one such
        # sample): from its first "not alive" on it must stay so, through the R of its exit.
        first_gone = next(i for i, (_, a) in enumerate(seen) if not a)
        after = seen[first_gone:]
        exiting = [a for state, a in after if state in ("R", "D")]
        assert exiting, seen[:5]  # the kernel took a while to free 1 GiB (scan: not yet)
        assert not any(a for _, a in after)
    finally:
        p.kill()
        p.wait()
