"""The ``etcdrun`` command (placeholder until the agent issue lands its full CLI)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from importlib.metadata import version

    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--version":
        print(f"etcdrun {version('etcdrun')}")
        return 0
    print("usage: etcdrun [--version] ...")
    return 0
