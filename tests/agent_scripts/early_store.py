"""Whether MASTER_PORT was already served when this script began, then a real gloo all_reduce
over it (tests/agent/test_standby.py: the rank-0 standby's early store).

``early_store.py OUT MODE``: writes ``OUT/store_<RANK>.json``; MODE is ignored. Listening is read
from /proc/net/tcp{,6} (a LISTEN socket on the port), not by connecting: a probe connection
would itself be a client of the store.
"""

import os
import sys


def listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fp:
                rows = fp.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "0A":
                return True
    return False


at_start = listening(int(os.environ["MASTER_PORT"]))

import json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
rank = os.environ["RANK"]
path = os.path.join(sys.argv[1], f"store_{rank}.json")
with open(path + ".tmp", "w") as fp:
    json.dump({"listening_at_start": at_start, "sum": t.item()}, fp)
os.replace(path + ".tmp", path)
dist.destroy_process_group()
