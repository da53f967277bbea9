"""A ``--prewarm`` module whose import takes ``SLOW_WARM_S`` seconds (default 0) and then writes
the wall time to ``SLOW_WARM_MARK`` (when set; ``{pid}`` in it becomes the importer's pid, so
that each standby leaves its own mark): a stand-in for ``import torch`` on a slow disk,
so that a test can tell what the agent did before and after its standbys were warm.
"""

import os
import time

time.sleep(float(os.environ.get("SLOW_WARM_S", "0")))
if os.environ.get("SLOW_WARM_MARK"):
    mark = os.environ["SLOW_WARM_MARK"].replace("{pid}", str(os.getpid()))
    with open(mark + ".tmp", "w") as fp:
        fp.write(repr(time.time()))
    os.replace(mark + ".tmp", mark)
