"""The hang watchdog against torchrun: how soon a hung rank is found, and what watching costs.

    python -m bench.hang [--timeout 5] [--repeat 3] [--cap 60]

Three measurements, printed as the markdown of bench/results/hang.md (its two tables):

1. **From the hang to the action.** One node, 4 gloo workers (tests/agent_scripts/hang_train.py),
   rank 3 sleeps inside step 20 while its peers wait in ``all_reduce``; ``--max-restarts 1``.
   Side by side in the same run: etcdrun ``--hang-timeout S``; torchrun with its FileTimer
   (``TORCHELASTIC_ENABLE_FILE_TIMER=1``, every step inside ``expires(after=S)``); torchrun
   without it. For each: the stuck worker's death after its last progress, the restarted
   workers' first step, and whether a line names the stuck frame (etcdrun: the verdict's
   time). A launcher that finds nothing within ``--cap`` seconds is stopped and said so.
2. **Cost per step** of ``etcdrun.elastic.progress(step)``: ns per call with the watchdog's
   page mapped, and without an agent (the no-op every plain run gets).
3. **etcd writes per node per minute** of a 2-node job (etcd backend) while it trains, nobody
   stuck, with and without ``--hang-timeout``: the revision's growth while the job runs, per
   node. The watchdog itself writes only when it raises an alarm.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.procs import become_subreaper, descendants, kill_pids, reap_orphans

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "agent_scripts" / "hang_train.py"
STUCK_RANK, STUCK_STEP = 3, 20


def _bin(name: str) -> str:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def _rows(out: Path) -> list[dict]:
    rows = []
    for p in out.glob("rank*.jsonl"):
        rows += [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]
    return rows


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def one_hang(kind: str, timeout: float, cap: float, work: Path) -> dict:
    """One launch of ``kind`` (etcdrun, torchrun+filetimer, torchrun); what happened when."""
    out, logs = work / "out", work / "logs"
    out.mkdir(parents=True)
    script = [str(SCRIPT), str(out), "sleep", str(STUCK_RANK), str(STUCK_STEP)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--standalone", "--nproc-per-node", "4", "--max-restarts", "1"]
    if kind == "etcdrun":
        argv = [_bin("etcdrun"), *common, "--prewarm", "none", "--hang-timeout", str(timeout)]
        argv += ["--log-dir", str(logs), *script]
    else:
        argv = [_bin("torchrun"), *common, *script]
        if kind == "torchrun+filetimer":
            argv.append(str(timeout))
            env["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    got: dict = {"launcher": kind}
    deadline = time.monotonic() + cap + 60
    hang = None
    while time.monotonic() < deadline:
        rows = _rows(out)
        hang = hang or next((r for r in rows if "hang" in r), None)
        if proc.poll() is not None and "launcher_exit_s" not in got:
            got["launcher_exit_s"] = time.time() - (hang["last_progress"] if hang else time.time())
        if hang is None:
            if proc.poll() is not None:
                break
            time.sleep(0.01)
            continue
        since = time.time() - hang["last_progress"]
        if "dead_s" not in got and not _alive(hang["pid"]):
            got["dead_s"] = since
        if "resumed_s" not in got and any(r["attempt"] == 1 and "step" in r for r in rows):
            got["resumed_s"] = since
        if since > cap or proc.poll() is not None and "dead_s" in got:
            break
        time.sleep(0.01)
    if proc.poll() is None:  # torchrun's workers outlive a killed agent: kill them first
        kill_pids([proc.pid, *descendants(proc.pid)])
    else:
        kill_pids(descendants(os.getpid()))  # a dead launcher's workers came to us (subreaper)
    proc.wait()
    reap_orphans()
    got["exit"] = proc.returncode
    verdicts = [
        json.loads(ln)
        for p in logs.rglob("events.jsonl")
        for ln in p.read_text().splitlines()
        if '"hang_verdict"' in ln
    ]
    if verdicts and hang is not None:
        got["line_s"] = verdicts[0]["time"] - hang["last_progress"]
        got["where"] = verdicts[0]["where"]
    return got


def progress_cost(n: int = 1_000_000) -> tuple[float, float]:
    """ns per ``progress()`` call: with a mapped page, and with no agent (a no-op)."""
    from etcdrun.agent.worker import beat

    with tempfile.TemporaryDirectory() as d:
        page = os.path.join(d, "progress")
        beat.create(page)
        writer = beat.Writer(page)
        t0 = time.perf_counter_ns()
        for i in range(n):
            writer.beat(i)
        mapped = (time.perf_counter_ns() - t0) / n
    import importlib

    module = importlib.import_module("etcdrun.elastic.progress")

    saved = module._writer
    module._writer = None  # as when ETCDRUN_PROGRESS_FILE is unset
    try:
        t0 = time.perf_counter_ns()
        for i in range(n):
            module.progress(i)
        off = (time.perf_counter_ns() - t0) / n
    finally:
        module._writer = saved
    return mapped, off


def etcd_writes(watchdog: bool, seconds: float, work: Path) -> float:
    """Revisions per node per minute while a 2-node job trains for ``seconds``."""
    from etcdrun.rendezvous.client import EtcdClient
    from etcdrun.rendezvous.localetcd import LocalEtcd

    with LocalEtcd() as etcd:
        client = EtcdClient(etcd.endpoints)
        out = work / "out"
        out.mkdir(parents=True)
        argv = [_bin("etcdrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend"]
        argv += ["etcd", "--rdzv-endpoint", etcd.endpoints, "--rdzv-id", "bench-hang"]
        argv += ["--prewarm", "none", "--log-dir", str(work / "logs")]
        argv += ["--hang-timeout", "5"] if watchdog else []
        argv += [str(SCRIPT), str(out), "sleep", "-1", "0"]
        agents = [
            subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(2)
        ]
        try:
            while len({r["rank"] for r in _rows(out)}) < 4:
                time.sleep(0.1)
            time.sleep(2)  # past the round's own writes
            before = client.status().header.revision
            time.sleep(seconds)
            after = client.status().header.revision
        finally:
            for a in agents:
                a.kill()
                a.wait()
            client.close()
            reap_orphans()
    return (after - before) / 2 / (seconds / 60)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timeout", type=float, default=5.0, help="S: --hang-timeout and expires()")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cap", type=float, default=60.0, help="give up on a launcher after this")
    p.add_argument("--writes-window", type=float, default=30.0)
    a = p.parse_args(argv)
    become_subreaper()
    kinds = ("etcdrun", "torchrun+filetimer", "torchrun")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.repeat):
            for kind in kinds:  # interleaved: the same machine state for each
                runs[kind].append(one_hang(kind, a.timeout, a.cap, Path(d) / f"{kind}-{i}"))
        writes = {
            (w,): etcd_writes(w, a.writes_window, Path(d) / f"writes-{w}") for w in (False, True)
        }
    print("## From the hang to the action\n")  # the page's headings: links into it stay put
    print(f"S = {a.timeout:g} s, 1 node x 4 gloo workers.\n")
    print(
        "| launcher | stuck worker killed after (s) | line naming the frame after (s) | "
        "restarted workers' first step after (s) | launcher exited after (s), code | frame named |"
    )
    print("|---|---|---|---|---|---|")
    for kind, rs in runs.items():

        def col(key: str, rs: list[dict] = rs) -> str:
            vals = [r[key] for r in rs if key in r]
            if not vals:
                return f"none within {a.cap:g} s"
            return ", ".join(f"{v:.2f}" for v in vals)

        where = next((r["where"] for r in rs if "where" in r), "no")
        ended = ", ".join(
            f"{r['launcher_exit_s']:.2f} ({r['exit']})" for r in rs if "launcher_exit_s" in r
        )
        print(
            f"| {kind} | {col('dead_s')} | {col('line_s')} | {col('resumed_s')} | "
            f"{ended or 'still running: stopped'} | {where} |"
        )
    mapped, off = progress_cost()
    print("\n## Cost\n")
    print(
        f"- `progress(step)`: {mapped:.0f} ns per call with the watchdog's page, "
        f"{off:.0f} ns without an agent (one million calls each)"
    )
    for (w,), rate in writes.items():
        print(
            f"- etcd writes per node per minute, 2 nodes training, watchdog "
            f"{'on' if w else 'off'}: {rate:.1f}"
        )


if __name__ == "__main__":
    main()
