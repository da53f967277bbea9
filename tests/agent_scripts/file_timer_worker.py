"""A worker under torch's FileTimer (torchrun parity): rank 1 overstays a 1 s timer in a scope
named ``stuck-in-step``; every other rank's timers are released in time.

argv: OUT_DIR. Each rank writes OUT_DIR/timer_<rank> once its timer is set.
"""

import os
import sys
import time

from torch.distributed.elastic.timer import FileTimerClient, configure, expires

configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
rank = int(os.environ["RANK"])
with expires(after=1, scope="quick-step"):
    pass  # released at once
with expires(after=1, scope="stuck-in-step"):
    open(os.path.join(sys.argv[1], f"timer_{rank}"), "w").close()
    time.sleep(60 if rank == 1 else 0.1)
