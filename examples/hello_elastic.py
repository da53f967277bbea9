"""The demo's worker: says who it is, a few times, slowly enough that a restart shows.

Run it under etcdrun (``examples/demo.py`` does): each line names the rendezvous round, the
global rank and the world size the agent gave this process, so when a node dies mid-job the
survivors' lines visibly switch to a new round with a smaller world. Standard library only: the
launcher needs no framework, and neither does this example.

Why the SIGTERM line: when membership changes, the agent stops its workers (SIGTERM) and starts
new ones in the next round; saying so makes that restart readable in the demo's output.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        sys.exit(f"hello_elastic: ${name} is not set; run me under etcdrun (see examples/demo.py)")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="lines to print (default 10)")
    parser.add_argument(
        "--interval", type=float, default=0.75, help="seconds between lines (default 0.75)"
    )
    args = parser.parse_args()

    rank, world = _env("RANK"), _env("WORLD_SIZE")
    rnd, node = os.environ.get("ETCDRUN_ROUND", "?"), _env("GROUP_RANK")
    me = f"round {rnd}: rank {rank} of {world} (node {node}, local rank {_env('LOCAL_RANK')})"

    def on_sigterm(signum: int, _frame: object) -> None:
        # The agent may send SIGTERM twice (forwarded, then its stop): say it once, with one
        # os.write (safe even if the signal interrupted a print).
        signal.signal(signum, signal.SIG_IGN)
        os.write(sys.stdout.fileno(), f"{me} stopped by the agent (SIGTERM)\n".encode())
        # Die by the signal itself, as if no handler were installed: the agent sees what it sent.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    for step in range(1, args.steps + 1):
        print(f"{me} step {step}/{args.steps}", flush=True)
        if step < args.steps:
            time.sleep(args.interval)
    print(f"{me} done", flush=True)


if __name__ == "__main__":
    main()
