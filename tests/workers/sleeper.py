"""Sleep until stopped. argv: <marker dir> [ignore-term|exit-on-term]. Writes ready_<RANK>, and
term_<RANK> when SIGTERM arrives (then ignores it, exits 0, or dies by default).
"""

import os
import signal
import sys
import time

marker_dir = sys.argv[1]
mode = sys.argv[2] if len(sys.argv) > 2 else "default"
rank = os.environ["RANK"]


def on_term(signum, frame):
    with open(os.path.join(marker_dir, f"term_{rank}"), "w") as fp:
        fp.write(str(signum))
    if mode == "exit-on-term":
        sys.exit(0)


if mode != "default":
    signal.signal(signal.SIGTERM, on_term)
# Written whole, then renamed: a reader that sees ready_<RANK> reads the pid, never an empty file.
ready = os.path.join(marker_dir, f"ready_{rank}")
with open(ready + ".tmp", "w") as fp:
    fp.write(str(os.getpid()))
os.replace(ready + ".tmp", ready)
for _ in range(1200):
    time.sleep(0.1)
