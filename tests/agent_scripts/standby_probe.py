"""What a worker can see of how it was started, dumped for tests/agent/test_standby.py to compare.

``standby_probe.py OUT MODE``: writes ``OUT/probe_<RANK>.json`` (atomically), then by MODE:
``ok`` exits 0, ``exit3`` exits 3, ``raise`` raises under ``@record`` (an error file),
``interrupt`` raises KeyboardInterrupt, ``sleep`` sleeps until killed. ``json_at_start``
tells whether a prewarmed module (json) was already imported before this script ran: the one
thing a standby is meant to change; ``gc_frozen_at_start``: whether objects were already in the
collector's permanent generation (a standby freezes what its imports built);
``torch_at_start``: which of torch and torch._dynamo were (``--prewarm auto``).
"""

import gc
import sys

json_at_start = "json" in sys.modules
gc_frozen_at_start = gc.get_freeze_count() > 0
torch_at_start = [m for m in ("torch", "torch._dynamo") if m in sys.modules]

import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import __main__  # noqa: E402
from etcdrun import record  # noqa: E402


def _proc(name):
    with open(f"/proc/self/{name}", "rb") as fp:
        return [x.decode() for x in fp.read().split(b"\0") if x]


def dump(out):
    info = {
        "json_at_start": json_at_start,
        "gc_frozen_at_start": gc_frozen_at_start,
        "torch_at_start": torch_at_start,
        "gc": [gc.isenabled(), list(gc.get_threshold())],  # the collector as the script found it
        "pid": os.getpid(),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv[1:],
        "file": __file__,
        "name": __name__,
        "path": sys.path,
        "main": [k for k in vars(__main__) if k.startswith("__")],
        "loader": type(__main__.__loader__).__name__,
        "spec": re.sub(" at 0x[0-9a-f]+", "", repr(__main__.__spec__)),
        "package": __main__.__package__,
        "env": dict(os.environ),
        "proc_env": sorted(_proc("environ")),
        "fds": sorted(os.listdir("/proc/self/fd")),
        "cwd": os.getcwd(),
        "excepthook": sys.excepthook is sys.__excepthook__,
    }
    tmp = os.path.join(out, f".probe_{os.environ['RANK']}.tmp")
    with open(tmp, "w") as fp:
        json.dump(info, fp)
    os.replace(tmp, os.path.join(out, f"probe_{os.environ['RANK']}.json"))


@record
def main():
    out, mode = sys.argv[1], sys.argv[2]
    dump(out)
    print(f"probe rank {os.environ['RANK']} {mode}", flush=True)
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError(f"probe failure on rank {os.environ['RANK']}")
    if mode == "interrupt":  # the interpreter then dies of SIGINT, after the traceback
        raise KeyboardInterrupt
    if mode == "sleep":
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
