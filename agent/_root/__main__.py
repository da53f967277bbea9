"""``python -m etcdrun ...``: the ``etcdrun`` command (same flags, same exit codes)."""

import sys

from etcdrun.agent.cli import main

if __name__ == "__main__":
    sys.exit(main())
