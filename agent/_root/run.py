"""``etcdrun.run``: torch.distributed.run's Python entry points, over etcdrun.

Why: programs that embed the launcher call ``torch.distributed.run.main(args)`` (or ``run`` on
its parsed arguments) and catch what it raises; they switch by changing the import:

    from etcdrun.run import main          # was: from torch.distributed.run import main
    main(["--nproc-per-node", "2", "train.py"])

The same names, shapes and errors as torch's: ``get_args_parser()``, ``parse_args(args)`` (a
Namespace), ``config_from_args(args)`` (LaunchConfig, cmd, cmd_args), ``run(args)`` and
``main(args=None)``, which raise ``ChildFailedError`` when the workers failed for good and
``ValueError`` for a mistake (etcdrun's UsageError is one, with one line; torch's argparse exits
with SystemExit(2) for some mistakes instead), and let SignalException and RendezvousError out.
``run`` and ``main`` return the workers' return values by global rank (torch's return None).
The console script ``etcdrun`` (and ``python -m etcdrun.run``) keeps its exit codes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from etcdrun.agent import cli
from etcdrun.agent.options import build_parser

__all__ = ["config_from_args", "get_args_parser", "main", "parse_args", "run"]

config_from_args = cli.config_from_args


def get_args_parser() -> argparse.ArgumentParser:
    """etcdrun's parser (torchrun's flags); prefixes are written out by ``parse_args``."""
    return build_parser()


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    return cli.parse_namespace(sys.argv[1:] if args is None else list(args))


def run(args: argparse.Namespace | Sequence[str]) -> dict[int, Any]:
    return cli.run(args)


def main(args: Sequence[str] | None = None) -> dict[int, Any]:
    """Parse ``args`` (default: ``sys.argv[1:]``) and run; raises as torch's ``main`` does."""
    return run(parse_args(args))


if __name__ == "__main__":  # python -m etcdrun.run: the console script, with its exit codes
    sys.exit(cli.main())
