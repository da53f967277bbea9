"""DDP's all-reduces end at a release even when gloo never ends them (etcdrun.elastic.inflight,
design.md §4a).

Why: gloo leaves a send that it queued after a failed write without an error when the
connection fails, and the collective behind it then waits out the group's 30 minutes; DDP's
backward waited with it, and a kept worker held its round and every peer
(bench/results/release_stress.md). Here the all-reduce that DDP is given never ends, as that send's,
and the release must still end the backward.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from agent_helpers import clean_env, unused_port

STUCK = """
import threading, time
import torch, torch.distributed as dist
from etcdrun.elastic.group import Group

dist.init_process_group("gloo", rank=0, world_size=1)
group = Group()
group.adopt()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
print("hooked", group.inflight.hook(model), flush=True)
x = torch.ones(8, 4)
for _ in range(2):  # DDP rebuilds its buckets after the first step
    model(x).sum().backward()


class Never:  # a collective gloo keeps running: its future never completes
    def get_future(self):
        return torch.futures.Future()


dist.all_reduce = lambda *a, **k: Never()
threading.Timer(0.5, group.release).start()
began = time.monotonic()
try:
    model(x).sum().backward()
    print("backward completed", flush=True)
except RuntimeError as e:
    print(f"released after {time.monotonic() - began:.2f} s: {e}", flush=True)
print("running", len(group.inflight.running()), flush=True)
group.drop()  # a collective gloo still runs: the group is kept, not destroyed (no join)
print("dropped, held", group.held.collectives, flush=True)
"""


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=unused_port(), **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_release_ends_ddps_backward_while_gloo_still_runs_its_allreduce(torch_available):
    out = _run(STUCK)
    lines = out.stdout.splitlines()
    assert "hooked True" in lines, out.stderr[-2000:]
    released = [ln for ln in lines if ln.startswith("released after")]
    assert released, out.stdout + out.stderr[-2000:]
    assert "the round ended" in released[0]
    assert float(released[0].split()[2]) < 5.0  # the release at 0.5 s, never gloo's timeout
    assert "running 1" in lines  # the collective gloo still runs is known ...
    assert "dropped, held 1" in lines  # ... counted for the agent's events, its group kept
    assert "still inside gloo" not in out.stderr  # and not printed: nothing to act on


SAME = """
import torch, torch.distributed as dist
from etcdrun.elastic.inflight import InFlight

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
nets = [torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)]
nets[1].load_state_dict(nets[0].state_dict())
own, hooked = (torch.nn.parallel.DistributedDataParallel(n) for n in nets)
assert InFlight().hook(hooked)
x = torch.arange(32, dtype=torch.float32).reshape(8, 4) * (rank + 1)
for model in (own, hooked):
    for _ in range(3):
        model.zero_grad()
        model(x).pow(2).sum().backward()
diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(*(n.parameters() for n in nets)))
print("max grad difference", diff, flush=True)
"""


def test_the_hook_averages_gradients_as_ddps_own_allreduce(torch_available):
    port = unused_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAME],
            env=clean_env(RANK=r, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ("0", "1")
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for out, err in outs:
        found = [ln for ln in out.splitlines() if ln.startswith("max grad difference")]
        assert found, err[-2000:]
        assert float(found[0].split()[-1]) == 0.0


OWN = """
import torch, torch.distributed as dist
from etcdrun.elastic.inflight import InFlight

dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
calls = []


def mine(state, bucket):
    calls.append(1)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


model.register_comm_hook(None, mine)
print("hooked", InFlight().hook(model), flush=True)
model(torch.ones(2, 4)).sum().backward()
print("script's hook calls", len(calls), flush=True)
"""


def test_a_scripts_own_hook_is_kept(torch_available):
    out = _run(OWN)
    assert "hooked False" in out.stdout, out.stderr[-2000:]
    assert "script's hook calls 1" in out.stdout


class _Work:
    """A collective's work as torch hands it out: its future, and the wait that makes the
    current stream wait for its result (NCCL's; gloo's returns at once).
    """

    def __init__(self, future: object) -> None:
        self.future = future
        self.waited = False

    def get_future(self) -> object:
        return self.future

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_wait_ends_with_gloos_result_or_at_the_release(torch_available):
    import threading

    import torch

    from etcdrun.elastic.inflight import FAILED, CollectiveEnded, InFlight

    inflight = InFlight()
    done, failing, stuck = (torch.futures.Future() for _ in range(3))
    done.set_result([torch.ones(1)])
    work = _Work(done)
    inflight.wait(work)
    assert work.waited, "the work itself is waited on once its future is done"
    failing.set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(CollectiveEnded, match=f"{FAILED}: .*Connection closed"):
        inflight.wait(_Work(failing))
    threading.Timer(0.2, inflight.end).start()
    with pytest.raises(CollectiveEnded, match="the round ended"):
        inflight.wait(_Work(stuck))  # gloo never ends it: the release does
    assert inflight.running() == [stuck]
    stuck.set_result([torch.ones(1)])  # gloo ends it at last: nothing is completed twice
    assert inflight.running() == []
    with pytest.raises(CollectiveEnded):  # a collective begun after the release
        inflight.wait(_Work(torch.futures.Future()))
    inflight.restart()
    fresh = torch.futures.Future()
    fresh.set_result([torch.zeros(1)])
    inflight.wait(_Work(fresh))


CARRIED = """
import os
import torch, torch.distributed as dist
from torch.distributed.distributed_c10d import _abort_process_group
from etcdrun import elastic
from etcdrun.elastic.inflight import InFlight

dist.init_process_group("gloo", rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
calls = []


def mine(state, bucket):
    calls.append(1)
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


model.register_comm_hook(None, mine)
state = elastic.TorchState(model=model)
state.attach(InFlight())
model(torch.ones(2, 4)).sum().backward()
_abort_process_group()  # the next round's group, as elastic.run forms it
os.environ["MASTER_PORT"] = os.environ["NEXT_PORT"]
dist.init_process_group("gloo", rank=0, world_size=1)
state.rewrap()
state.attach(InFlight())
model(torch.ones(2, 4)).sum().backward()
print("script's hook calls", len(calls), "hooks", len(model._comm_hooks), flush=True)
"""


def test_a_scripts_own_hook_is_carried_to_the_next_rounds_wrapper(torch_available):
    """Survivors re-wrap DDP at each round while a newcomer's script registers its hook on its
    own wrapper: without the carry, survivors and newcomers would reduce gradients differently.
    """
    out = _run(CARRIED, NEXT_PORT=unused_port())
    assert "script's hook calls 2 hooks 1" in out.stdout, out.stdout + out.stderr[-2000:]
