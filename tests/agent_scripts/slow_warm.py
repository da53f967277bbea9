"""A ``--prewarm`` module whose import takes ``SLOW_WARM_S`` seconds (default 0) and then writes
the wall time to ``SLOW_WARM_MARK`` (when set): a stand-in for ``import torch`` on a slow disk,
so that a test can tell what the agent did before and after its standbys were warm."""

import os
import time

time.sleep(float(os.environ.get("SLOW_WARM_S", "0")))
if os.environ.get("SLOW_WARM_MARK"):
    with open(os.environ["SLOW_WARM_MARK"] + ".tmp", "w") as fp:
        fp.write(repr(time.time()))
    os.replace(os.environ["SLOW_WARM_MARK"] + ".tmp", os.environ["SLOW_WARM_MARK"])
