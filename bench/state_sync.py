"""State commit and sync, measured beside torchft 0.2.0's checkpoint transports.

Usage: ``python -m bench.state_sync [--quick] [--reps N] [--commit-mb 10,100,1024] ...``

Why: in-place recovery rests on two claims (docs/in-place.md, "What a commit costs"): a commit
copies the state into host buffers it keeps, cheaper than the deep copy etcdrun made before, and
``sync()`` streams the newest commit to every rank at loopback speed with no more extra memory
than one bucket (elastic/stream.py). This bench turns both into numbers on gloo over loopback,
and runs torchft 0.2.0's transports (``PGTransport``, ``HTTPTransport``) on the same state.

How: every case runs in fresh processes the bench spawns (state_sync_worker.py), each building a
``TorchState`` of a transformer-shaped module and its Adam state (hundreds of small tensors, a
few large) of the size asked for. Times are medians over ``--reps``; peak extra memory is the
kernel's peak RSS (VmHWM, reset through /proc/self/clear_refs before each measured call; a
1 ms sampling thread of VmRSS where that reset is refused) above the RSS just before the call.
Every worker runs with ``OMP_NUM_THREADS=1`` (``--threads``), as etcdrun starts workers when
``--nproc-per-node`` is above 1: with torch's two threads, the many small copies that pack a
bucket waited on each other and on gloo's threads, and a sync on this 2-core machine ran several
times slower. torchft runs in its own venv (``--torchft-python``; by default
``$TORCHFT_PYTHON``, this python if it has torchft, or bench/.venv-torchft). The page goes to
bench/results/state_sync.md; ``--quick`` is a small run (under a minute) that writes only where
``--out`` says.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.state_sync_worker import MB, PREFIX, TIMEOUT_S, read_kb

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "bench" / "results" / "state_sync.md"
HEADINGS = (
    "## What it measures",
    "## Commit",
    "## Sync at 1 GB",
    "## Against torchft 0.2.0",
    "## How to run",
)
TORCHFT_KINDS = {
    "pg-inplace": "PGTransport, received in place",
    "pg": "PGTransport, into new tensors",
    "http": "HTTPTransport (the Manager's default)",
}


# ---- the harness -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(python: str, specs: list[dict[str, Any]], threads: int) -> list[dict[str, Any]]:
    """One fresh worker process per spec, all at once, with ``OMP_NUM_THREADS=threads``; their
    results in spec order. A worker that fails ends the others (a group waits on every rank)
    and raises with its stderr's tail.
    """
    env = os.environ | {"OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp, f"{i}.out") for i in range(len(specs))]
        errs = [Path(tmp, f"{i}.err") for i in range(len(specs))]
        procs = []
        for spec, out, err in zip(specs, outs, errs, strict=True):
            cmd = [python, "-m", "bench.state_sync_worker", json.dumps(spec)]
            with out.open("w") as o, err.open("w") as e:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o, stderr=e))
        started = time.monotonic()
        try:
            _wait_all(procs, started + TIMEOUT_S)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        took = time.monotonic() - started
        print(f"state_sync: {specs[0]['kind']} x{len(specs)}: {took:.1f} s", file=sys.stderr)
        ranks = list(zip(procs, outs, errs, strict=True))
        ranks.sort(key=lambda r: r[0].returncode <= 0)  # a rank that failed first: its error
        results = {id(p): _result(p, o, e) for p, o, e in ranks}
        return [results[id(p)] for p in procs]


def _wait_all(procs: list[subprocess.Popen], deadline: float) -> None:
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            return  # a rank failed: the others would wait on it until their timeout
        if time.monotonic() > deadline:
            raise RuntimeError(f"a case ran past {TIMEOUT_S} s")
        time.sleep(0.05)


def _result(proc: subprocess.Popen, out: Path, err: Path) -> dict[str, Any]:
    lines = [x for x in out.read_text().splitlines() if x.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        last = (err.read_text().strip().splitlines() or ["(no stderr)"])[-1]  # the exception
        last = last.replace("|", "/")  # it lands in a table cell
        raise RuntimeError(f"worker exited {proc.returncode}: {last[-300:]}")
    return json.loads(lines[-1][len(PREFIX) :])


def _case(python: str, specs: list[dict[str, Any]], threads: int, **about: Any) -> dict[str, Any]:
    """A multi-rank case: its ranks' results, or the error that ended it (kept on the page)."""
    port = _free_port()
    ranks = [s | {"rank": r, "world": len(specs), "port": port} for r, s in enumerate(specs)]
    try:
        return about | {"results": spawn(python, ranks, threads)}
    except RuntimeError as e:
        print(f"state_sync: {about}: {e}", file=sys.stderr)
        return about | {"error": str(e)}


def run_commit(args: argparse.Namespace) -> list[dict[str, Any]]:
    specs = [{"kind": "commit", "bytes": mb * MB, "reps": args.reps} for mb in args.commit_mb]
    return [spawn(sys.executable, [s], args.threads)[0] for s in specs]


def run_sync(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The bucket sizes at the first rank count; the default bucket at the others."""
    from etcdrun.elastic import stream

    default = stream.BUCKET_BYTES // MB
    cases = [(args.ranks[0], b) for b in args.buckets_mb] + [(n, default) for n in args.ranks[1:]]
    out = []
    for n, bucket in cases:
        spec = {"kind": "sync", "bytes": args.sync_mb * MB, "bucket": bucket * MB}
        spec["reps"] = args.reps
        out.append(_case(sys.executable, [spec] * n, args.threads, ranks=n, bucket_mb=bucket))
    return out


def run_torchft(args: argparse.Namespace, python: str | None) -> list[dict[str, Any]]:
    """Every transport at the first rank count; PGTransport in place at the others."""
    if python is None:
        return []
    cases = [(args.ranks[0], k) for k in args.torchft_kinds]
    cases += [(n, "pg-inplace") for n in args.ranks[1:] if "pg-inplace" in args.torchft_kinds]
    out = []
    for n, kind in cases:
        spec = {"kind": "torchft", "transport": kind, "bytes": args.sync_mb * MB}
        spec["reps"] = args.reps
        out.append(_case(python, [spec] * n, args.threads, ranks=n, transport=kind))
    return out


def torchft_python(given: str | None) -> str | None:
    """The python that has torchft: ``--torchft-python``, $TORCHFT_PYTHON, this one, or
    bench/.venv-torchft's; None when none has it.
    """
    import importlib.util

    venv = ROOT / "bench" / ".venv-torchft" / "bin" / "python"
    for python in (given, os.environ.get("TORCHFT_PYTHON")):
        if python:
            return python
    if importlib.util.find_spec("torchft") is not None:
        return sys.executable
    return str(venv) if venv.exists() else None


# ---- the figures -------------------------------------------------------------------------------
def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 0.1 else f"{s * 1e3:.0f} ms"


def _gbs(nbytes: float, s: float) -> str:
    return f"{nbytes / s / (1 << 30):.2f}"


def _mb(nbytes: float) -> str:
    return f"{nbytes / MB:.1f} MB" if nbytes < 100 * MB else f"{nbytes / MB:.0f} MB"


def sync_summary(case: dict[str, Any]) -> dict[str, Any]:
    """Per rep: ``sync()``'s time on the slowest rank, its phases on the slowest receiver (the
    source restores nothing: its agreement check waits for theirs), the worst receiver's peak
    extra; then medians over the reps.
    """
    results = case["results"]
    recv = [r for r in results if not r["source"]]
    src = next(r for r in results if r["source"])
    reps = []
    for i in range(len(src["runs"])):
        runs, theirs, mine = [r["runs"][i] for r in results], [r["runs"][i] for r in recv], src
        rep = {"total": max(x["total_s"] for x in runs), "sent": mine["runs"][i]["sent"]}
        for phase in ("gather", "broadcast", "load", "agree"):
            rep[phase] = max(x["times"][phase] for x in theirs)
        rep["recv_broadcast"] = max(x["extra"]["broadcast"] for x in theirs)
        rep["recv_extra"] = max(max(x["extra"].values()) for x in theirs)
        rep["src_extra"] = max(mine["runs"][i]["extra"].values())
        reps.append(rep)
    out = {k: statistics.median(rep[k] for rep in reps) for k in reps[0]}
    return out | {"reused": all(x["reused"] for r in recv for x in r["runs"])}


def torchft_summary(case: dict[str, Any]) -> dict[str, Any]:
    results = case["results"]
    recv = [r for r in results if not r["source"]]
    src = next(r for r in results if r["source"])
    reps = []
    for i in range(len(src["runs"])):
        runs, theirs = [r["runs"][i] for r in results], [r["runs"][i] for r in recv]
        rep = {"transport": max(x["transport_s"] for x in runs)}
        rep["load"] = max(x["load_s"] for x in theirs)
        rep["recv_extra"] = max(x["extra"] for x in theirs)
        rep["src_extra"] = src["runs"][i]["extra"]
        reps.append(rep)
    out = {k: statistics.median(rep[k] for rep in reps) for k in reps[0]}
    return out | {"sent": src["sent"]}


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def commit_section(rows: list[dict[str, Any]]) -> list[str]:
    head = ["state", "tensors", "commit", "per MB", "GB/s", "first commit (allocates)"]
    head += ["deepcopy (before)", "per MB", "commit faster by", "peak extra: commit", "deepcopy"]
    table = []
    for r in rows:
        c, d, mb = statistics.median(r["commit_s"]), statistics.median(r["deep_s"]), r["bytes"] / MB
        table.append(
            [_mb(r["bytes"]), str(r["tensors"]), _ms(c), f"{c * 1e3 / mb:.2f} ms"]
            + [_gbs(r["bytes"], c), _ms(r["first_s"]), _ms(d), f"{d * 1e3 / mb:.2f} ms"]
            + [f"{d / c:.1f}×", _mb(statistics.median(r["commit_extra"]))]
            + [_mb(statistics.median(r["deep_extra"]))]
        )
    text = (
        "`State.commit()` of a `TorchState(model=, optimizer=)` against what etcdrun did before, "
        "`copy.deepcopy(model.state_dict())` and `copy.deepcopy(optimizer.state_dict())`, in one "
        "process per size. Medians; the first commit (the "
        "state's constructor) allocates the buffers every later commit reuses."
    )
    return [text, "", *_table(head, table)]


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def sync_section(cases: list[dict[str, Any]], bucket: int) -> list[str]:
    head = ["ranks", "bucket", "sync()", "GB/s", "broadcast", "GB/s", "restore", "agreement check"]
    head += ["peak extra, receiver: broadcast", "whole sync()", "peak extra, source"]
    head += ["buffers reused"]
    table, verdicts, size = [], [], 0
    for case in cases:
        if "error" in case:
            table.append(
                [str(case["ranks"]), f"{case['bucket_mb']} MB", f"failed: {case['error']}"]
            )
            continue
        s = sync_summary(case)
        size = s["sent"]
        table.append(
            [str(case["ranks"]), f"{case['bucket_mb']} MB", _ms(s["total"]), _gbs(size, s["total"])]
            + [_ms(s["broadcast"]), _gbs(size, s["broadcast"]), _ms(s["load"]), _ms(s["agree"])]
            + [_mb(s["recv_broadcast"]), _mb(s["recv_extra"]), _mb(s["src_extra"])]
            + ["yes" if s["reused"] else "no"]
        )
        if case["bucket_mb"] * MB == bucket:
            fast, whole = size / s["broadcast"] >= 1 << 30, size / s["total"] >= 1 << 30
            small, all_small = (s[k] <= bucket + MB for k in ("recv_broadcast", "recv_extra"))
            verdicts.append(
                f"- {case['ranks']} ranks: ≥ 1 GB/s {_met(fast)} by the broadcast, {_met(whole)} "
                f"by the whole `sync()`; ≤ one bucket {_met(small)} by the broadcast "
                f"({_mb(s['recv_broadcast'])}), {_met(all_small)} by the whole `sync()` "
                f"({_mb(s['recv_extra'])})."
            )
    text = (
        f"`State.sync()` of a {_mb(size)} state (the same module and Adam state) from the rank "
        "with the newest commit (the last rank, which committed once more) to the others, which "
        'committed the same layout before, so they receive into their own buffers ("buffers '
        'reused"). Its phases are timed from inside: the broadcast (stream.py), the restore '
        "into the live module and optimizer, the agreement check (each rank's live state "
        "against what it synced, and one all_gather, agree.py); `sync()` is all of them plus "
        "the gather of the commit counts. "
        "`sync()` is timed on the slowest rank, its phases on the slowest receiver; GB/s is the "
        "state's bytes over that time; peak extra is the worst receiver's above its RSS just "
        "before `sync()`."
    )
    targets = (
        f"Targets (the issue): ≥ 1 GB/s; peak extra ≤ one bucket ({_mb(bucket)}, and 1 MB for "
        "the pickled skeleton and the allocator's pages):"
    )
    why = (
        "On gloo, a tensor of `stream.IN_PLACE_BYTES` (1 MB) or more is broadcast in place, from "
        "and into its memory, a bucket at most at a time; only smaller ones pass through the "
        "bucket, so its size bounds the staging rather than sets it."
    )
    return [text, "", *_table(head, table), "", targets, "", *verdicts, "", why]


def torchft_section(tf: list[dict[str, Any]], sync: list[dict[str, Any]], python: str | None):
    if python is None:
        return ["Not measured: no python with torchft (`--torchft-python`, see How to run)."]
    head = ["transport", "ranks", "moves the state", "GB/s", "then loads", "end to end", "GB/s"]
    head += ["peak extra, receiver", "peak extra, source"]
    table = []
    for case in sync:
        if "error" in case:
            continue
        s = sync_summary(case)
        rest, bucket = s["total"] - s["broadcast"], f"bucket {case['bucket_mb']} MB"
        table.append(
            [f"etcdrun `sync()` ({bucket})", str(case["ranks"]), _ms(s["broadcast"])]
            + [_gbs(s["sent"], s["broadcast"]), _ms(rest), _ms(s["total"])]
            + [_gbs(s["sent"], s["total"]), _mb(s["recv_extra"]), _mb(s["src_extra"])]
        )
    for case in tf:
        name = f"torchft {TORCHFT_KINDS[case['transport']]}"
        if "error" in case:
            table.append([name, str(case["ranks"]), f"failed: {case['error']}"])
            continue
        s = torchft_summary(case)
        end = s["transport"] + s["load"]
        table.append(
            [name, str(case["ranks"]), _ms(s["transport"]), _gbs(s["sent"], s["transport"])]
            + [_ms(s["load"]), _ms(end), _gbs(s["sent"], end), _mb(s["recv_extra"])]
            + [_mb(s["src_extra"])]
        )
    text = (
        "torchft 0.2.0's checkpoint transports on the same state, in the same fresh processes' "
        'way: the last rank sends `{"model": model.state_dict(), "opt": opt.state_dict()}`, '
        "the others receive it and load it as torchft's `Manager` does (`load_state_dict` of "
        "each object). PGTransport over torchft's `ProcessGroupGloo`: in place (its "
        "`state_dict=` callback, received into the live tensors) and into new tensors; "
        "HTTPTransport (torch.save streamed over HTTP, torchft's default). For etcdrun, \"moves "
        'the state" is the broadcast and "then loads" the rest of `sync()` (restore and '
        "agreement check). Peak extra: the worst receiver's and the source's, measured alike."
    )
    return [text, "", *_table(head, table)]


def _machine() -> str:
    cpu = next(
        (
            x.split(":", 1)[1].strip()
            for x in Path("/proc/cpuinfo").read_text().splitlines()
            if x.startswith("model name")
        ),
        platform.machine(),
    )
    mem = read_kb("/proc/meminfo", "MemTotal") / (1 << 20)
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GB RAM, Linux {platform.release()}"


def _tree() -> str:
    """The commit measured, and the files of etcdrun.elastic that differ from it."""

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return run.stdout.rstrip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "an unknown commit"
    changed = git("status", "--porcelain", "--", "agent/elastic").splitlines()
    files = [x[3:].removeprefix("agent/elastic/") for x in changed]
    return head + (f", with local changes to {', '.join(files)}" if files else "")


def run_section(data: dict[str, Any]) -> list[str]:
    meta, tf = data["meta"], [c for c in data["torchft"] if "results" in c]
    torchft = tf[0]["results"][0]["torchft"] if tf else "not measured"
    venv = "bench/.venv-torchft"
    return [
        f"Command: `{meta['command']}` ({meta['seconds']:.0f} s)",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}; gloo over loopback",
        f"- etcdrun at {meta['tree']}",
        f"- python {platform.python_version()}, torch {meta['torch']}, torchft {torchft}"
        + (f" (`{data['torchft_python']}`)" if tf else ""),
        f"- peak memory from: {meta['memory']}; {meta['reps']} repetitions per case",
        f"- every worker with OMP_NUM_THREADS={meta['threads']}; load average (1 min) "
        f"{meta['load'][0]:.1f} before the run, {meta['load'][1]:.1f} after",
        "",
        "torchft runs in a venv of its own, which sees this python's torch:",
        "",
        "```sh",
        f"python -m venv --system-site-packages {venv} && {venv}/bin/pip install torchft==0.2.0",
        "python -m bench.state_sync                # the page above; --help for sizes and reps",
        "python -m bench.state_sync --quick --out /tmp/state_sync.md   # under a minute",
        "```",
    ]


def render(data: dict[str, Any]) -> str:
    from etcdrun.elastic import stream

    intro = (
        "What a commit and a `sync()` of etcdrun's in-place state cost (docs/in-place.md, "
        '"What a commit costs"), and torchft 0.2.0\'s checkpoint transports on the same '
        "state: a transformer-shaped module and its Adam state (float32; many small tensors, a "
        "few large), every case in fresh processes, gloo over loopback. MB and GB are 2^20 and "
        "2^30 bytes. Peak extra memory: the kernel's peak RSS of the process during the call "
        "(VmHWM, reset before it) above its RSS just before it, the allocator's free memory "
        "handed back first (`malloc_trim`), so that every repetition needs what a first call in "
        "a fresh process does."
    )
    sections = [
        [intro],
        commit_section(data["commit"]),
        sync_section(data["sync"], stream.BUCKET_BYTES),
        torchft_section(data["torchft"], data["sync"], data["torchft_python"]),
        run_section(data),
    ]
    lines = ["# State commit and sync (bench/state_sync.py)", ""]
    for heading, body in zip(HEADINGS, sections, strict=True):
        lines += [heading, "", *body, ""]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    def mbs(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(
        prog="python -m bench.state_sync",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a small run, under a minute")
    p.add_argument("--commit-mb", type=mbs, help="state sizes of the commit table")
    p.add_argument("--sync-mb", type=int, help="the state size of the sync tables (1024)")
    p.add_argument("--ranks", type=mbs, help="rank counts (2,3); buckets swept at the first")
    p.add_argument("--buckets-mb", type=mbs, help="bucket sizes (8,32,128)")
    p.add_argument("--torchft-kinds", type=lambda t: t.split(","), help=",".join(TORCHFT_KINDS))
    p.add_argument("--reps", type=int, help="repetitions per case (5; --quick: 2)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of every worker (1: what etcdrun gives with --nproc-per-node > 1)",
    )
    p.add_argument("--torchft-python", help="a python with torchft 0.2.0")
    p.add_argument("--no-torchft", action="store_true")
    p.add_argument("--out", type=Path, help=f"the page (default {PAGE.relative_to(ROOT)})")
    args = p.parse_args(argv)
    quick = {"commit_mb": [16], "sync_mb": 48, "ranks": [2], "buckets_mb": [32]}
    quick |= {"torchft_kinds": ["pg-inplace"], "reps": 2, "out": None}
    full = {"commit_mb": [10, 32, 100, 320, 1024], "sync_mb": 1024, "ranks": [2, 3]}
    full |= {"buckets_mb": [8, 32, 128], "torchft_kinds": list(TORCHFT_KINDS), "reps": 5}
    for key, value in (quick if args.quick else full | {"out": PAGE}).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse(argv)

    t0, load = time.monotonic(), os.getloadavg()[0]
    python = None if args.no_torchft else torchft_python(args.torchft_python)
    data: dict[str, Any] = {"commit": run_commit(args), "sync": run_sync(args)}
    data |= {"torchft": run_torchft(args, python), "torchft_python": python}
    command = " ".join(
        ["python -m bench.state_sync", *(argv if argv is not None else sys.argv[1:])]
    )
    data["meta"] = {
        "command": command,
        "seconds": time.monotonic() - t0,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "tree": _tree(),
        "torch": torch.__version__,
        "memory": data["commit"][0]["memory"],
        "reps": args.reps,
        "threads": args.threads,
        "load": (load, os.getloadavg()[0]),
    }
    page = render(data)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
