"""Do successful gloo jobs end cleanly? N launches of each case under etcdrun and under torchrun,
interleaved, counted as exit 0 / SIGABRT / other, side by side.

Why this exists: torch 2.13 + gloo workers were killed by SIGABRT while Python finalized
("terminate called without an active exception"; root cause and fix: agent/worker/_site/
sitecustomize.py). Whether a launcher shows it is a matter of odds, so the claim is a count.

    python -m bench.clean_exit [--n 50] [--cases a,b,c,d,e,f] [--launchers etcdrun,torchrun]

Cases (single node, static backend, ``--max-restarts 0``):
  a  --run-path tests/agent_scripts/init_method.py, 4 workers, init env://  (torch's own test)
  b  the same with init tcp://127.0.0.1:<master port>
  c  elastic_launch of a callable doing one all_reduce, 3 workers (etcdrun's / torch's API)
  d  tests/agent_scripts/ddp_train.py as a script, 4 workers
  e  init_method.py as a script, init env://
  f  init_method as a module (-m), init env://

Uses this interpreter (torch must be installed) and the ``etcdrun``/``torchrun`` beside it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "tests" / "agent_scripts"
OK, ABORT, OTHER = "exit 0", "SIGABRT", "other"
LAUNCHERS = ("etcdrun", "torchrun")
TIMEOUT = 180.0  # one launch; a hang counts as "other"
_ABORT_MARKS = ("terminate called without an active exception", "SIGABRT", "Signal 6 ")


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    nproc: int
    kind: str  # run_path, script, module or callable
    target: str  # script path, module name, or the callable driver script
    init: str | None = None  # env or tcp: the --init-method given to init_method.py


CASES = {
    c.key: c
    for c in (
        Case("a", "--run-path, init env:// (4 workers)", 4, "run_path", "init_method.py", "env"),
        Case("b", "--run-path, init tcp:// (4 workers)", 4, "run_path", "init_method.py", "tcp"),
        Case("c", "elastic_launch callable (3 workers)", 3, "callable", "allreduce_callable.py"),
        Case("d", "ddp_train.py script (4 workers)", 4, "script", "ddp_train.py"),
        Case("e", "script, init env:// (4 workers)", 4, "script", "init_method.py", "env"),
        Case("f", "-m module, init env:// (4 workers)", 4, "module", "init_method", "env"),
    )
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_bin(name: str) -> str:
    beside = Path(sys.executable).parent / name
    if not beside.exists():
        sys.exit(f"clean_exit: no {name} beside {sys.executable} (pip install -e '.[test]')")
    return str(beside)


def command(case: Case, launcher: str) -> list[str]:
    """The launch command of ``case``: the same flags for both launchers."""
    if case.kind == "callable":
        api = "torch" if launcher == "torchrun" else "etcdrun"
        return [sys.executable, str(SCRIPTS / case.target), api]
    port = free_port()
    cmd = [launcher_bin(launcher), "--nnodes", "1", "--nproc-per-node", str(case.nproc)]
    cmd += ["--rdzv-backend", "static", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(port), "--max-restarts", "0"]
    if case.kind == "run_path":
        cmd.append("--run-path")
    if case.kind == "module":
        cmd += ["-m", case.target]
    else:
        cmd.append(str(SCRIPTS / case.target))
    if case.init == "env":
        cmd += ["--init-method", "env://"]
    elif case.init == "tcp":
        # The master's port: torchrun's workers connect to its agent's store there
        # (TORCHELASTIC_USE_AGENT_STORE); etcdrun's rank 0 hosts the store there.
        cmd += ["--init-method", f"tcp://127.0.0.1:{port}"]
    return cmd


def clean_env() -> dict[str, str]:
    """Our environment without what would change a launcher's or a worker's behaviour."""
    drop = ("PET_", "TORCHELASTIC_", "OMP_NUM_THREADS", "PYTHON_EXEC", "MASTER_", "LOGLEVEL")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    # The launcher runs in its own session; its workers (torchrun's in sessions of their own)
    # are found through the process tree.
    from bench.procs import descendants

    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(case: Case, launcher: str) -> tuple[str, str]:
    """Run ``case`` once; (outcome, the output's tail)."""
    proc = subprocess.Popen(
        command(case, launcher),
        cwd=SCRIPTS,  # -m finds the module here
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        out, _ = proc.communicate()
        return OTHER, f"timed out after {TIMEOUT:g} s\n{out[-3000:]}"
    if proc.returncode == 0:
        return OK, out[-3000:]
    outcome = ABORT if any(m in out for m in _ABORT_MARKS) else OTHER
    return outcome, out[-3000:]


def run(n: int, cases: list[Case], launchers: list[str], verbose: bool) -> dict:
    counts = {(c.key, lch): Counter() for c in cases for lch in launchers}
    for case in cases:
        t0 = time.monotonic()
        for i in range(n):
            for lch in launchers:  # interleaved: the machine's load hits both alike
                outcome, tail = launch(case, lch)
                counts[case.key, lch][outcome] += 1
                if verbose and outcome == OTHER:
                    print(f"--- {case.key} {lch} run {i}: {outcome}\n{tail}", file=sys.stderr)
        print(f"case {case.key} done in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return counts


def table(n: int, cases: list[Case], launchers: list[str], counts: dict) -> str:
    rows = [f"| case | launcher | launches | {OK} | {ABORT} | {OTHER} |", "|---" * 6 + "|"]
    for case in cases:
        for lch in launchers:
            c = counts[case.key, lch]
            torch_api = case.kind == "callable" and lch == "torchrun"
            name = "torch's elastic_launch" if torch_api else lch
            rows.append(
                f"| {case.key}. {case.label} | {name} | {n} | {c[OK]} | {c[ABORT]} | {c[OTHER]} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50, help="launches per case and launcher")
    ap.add_argument("--cases", default=",".join(CASES), help="comma list of case letters")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument("-v", "--verbose", action="store_true", help="print 'other' outcomes")
    ns = ap.parse_args(argv)
    try:
        cases = [CASES[k] for k in ns.cases.split(",")]
    except KeyError as e:
        ap.error(f"unknown case {e.args[0]!r} (cases: {', '.join(CASES)})")
    launchers = ns.launchers.split(",")
    if not set(launchers) <= set(LAUNCHERS):
        ap.error(f"--launchers: choose among {', '.join(LAUNCHERS)}")
    t0 = time.monotonic()
    counts = run(ns.n, cases, launchers, ns.verbose)
    load = os.getloadavg()[0]
    print(f"{ns.n} launches per row, {os.cpu_count()} CPUs, 1-min load {load:.2f} at the end,")
    took, py = time.monotonic() - t0, sys.version.split()[0]
    print(f"{took:.0f} s in all. torch {_torch_version()}, Python {py}")
    print(table(ns.n, cases, launchers, counts))
    return 0


def _torch_version() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
