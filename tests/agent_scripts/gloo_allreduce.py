"""A gloo job across hosts: every worker records its start, then all_reduces its RANK + 1.

argv: <out dir>. The start record has worker.py's name and shape (``start_<round>_<rank>_<pid>``
with env, pid, ppid, time) plus the worker's network namespace, so a test can tell that the ranks
really ran on different hosts. The sum (1 + ... + WORLD_SIZE) is printed by every rank: each
has then exchanged data with every other through MASTER_ADDR's store and gloo's own sockets.
"""

import json
import os
import sys
import time

out = sys.argv[1]
record = {
    "env": dict(os.environ),
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "t": time.time(),
    "netns": os.readlink("/proc/self/ns/net"),
}
name = f"start_{os.environ['ETCDRUN_ROUND']}_{os.environ['RANK']}_{os.getpid()}.json"
with open(os.path.join(out, name + ".tmp"), "w") as fp:
    json.dump(record, fp)
os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))

import torch  # noqa: E402  (after the record: the test sees the start before torch's import)
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum {int(t.item())}", flush=True)
dist.destroy_process_group()
