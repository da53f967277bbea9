"""One of N processes meeting through an EtcdStore: gloo's init_process_group(store=...), then
the store patterns torchrun's agent uses (torch's own elastic store utilities), then a race.

argv: endpoints prefix rank world. Prints one JSON line of results; the test compares them.
"""

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.utils import store as store_util

from etcdrun.rendezvous.client import EtcdClient
from etcdrun.rendezvous.torch.store import EtcdStore

endpoints, prefix, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
client = EtcdClient(endpoints)
lease = client.lease(10)
store = EtcdStore(client, prefix, lease=lease.id, timeout=datetime.timedelta(seconds=60))
out = {"rank": rank}

dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
out["all_reduce"] = t.item()
group = dist.new_group(list(range(world)))  # another round of store traffic (its own prefix)
t2 = torch.ones(1)
dist.all_reduce(t2, group=group)
out["group_all_reduce"] = t2.item()

# torchrun's agent: a barrier (add + set + wait) and synchronize (set + multi_get + barrier).
store_util.barrier(store, world, key_prefix="test/barrier", barrier_timeout=60)
data = store_util.synchronize(store, f"hello {rank}".encode(), rank, world, "test/sync/", 60)
out["synchronize"] = [d.decode() for d in data]
out["counter"] = store.add("test/counter", 1)
won = store.compare_set("test/owner", "", f"rank {rank}")
out["owner"] = won.decode()
store_util.barrier(store, world, key_prefix="test/barrier2", barrier_timeout=60)
out["counter_after"] = int(store.get("test/counter"))
out["owner_after"] = store.get("test/owner").decode()
# Every key is leased by its writer: nobody leaves (revoking its keys) before all have read.
store_util.barrier(store, world, key_prefix="test/barrier3", barrier_timeout=60)
dist.destroy_process_group()
print(json.dumps(out), flush=True)
client.close()
