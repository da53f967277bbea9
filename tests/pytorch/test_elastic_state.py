"""A state's values, by their handlers; its commits, as host copies; its sync, streamed tensor by
tensor; and the agreement check (etcdrun.elastic: handlers, snapshot, stream, agree).

Why: a scheduler deep-copied away from its optimizer drove a copy nobody trained with, a commit
deep-copied the state on every step, a sync pickled everything into one blob and decoded it with
numpy (which torch does not bring), and replicas that parted trained on without a word.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from agent_helpers import SCRIPTS, clean_env, unused_port

NO_NUMPY = str(SCRIPTS / "no_numpy")


def _trained(steps: int):
    import torch

    from etcdrun import elastic

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100)
    state = elastic.TorchState(model=model, optimizer=opt, scheduler=sched, step=0, seen=[])

    def step() -> None:
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        state.step += 1
        state.seen.append(state.step)

    for _ in range(steps):
        step()
        state.commit()
    return state, model, opt, sched, step


def test_a_restore_puts_the_commit_back_into_the_live_objects(torch_available):
    import torch

    state, model, opt, sched, step = _trained(5)
    weight, lr = model.weight.detach().clone(), opt.param_groups[0]["lr"]
    momentum = opt.state[model.weight]["momentum_buffer"].clone()
    for _ in range(3):
        step()
    state.restore()
    assert torch.equal(model.weight, weight)
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 5
    assert sched.optimizer is opt, "the scheduler drives the live optimizer, not a copy"
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)
    assert (state.step, state.seen) == (5, [1, 2, 3, 4, 5])
    step()  # training after a restore must not write into the commit (no shared tensors)
    state.restore()
    assert torch.equal(opt.state[model.weight]["momentum_buffer"], momentum)


def test_a_commit_reuses_its_host_buffers(torch_available):
    state, *_ = _trained(2)
    before = [t.data_ptr() for t in state._shared.tensors]
    state.commit()
    assert [t.data_ptr() for t in state._shared.tensors] == before


def test_a_value_without_a_handler_is_refused_with_the_remedy_and_one_can_be_registered(
    torch_available,
):
    from etcdrun import elastic

    class Counter:
        def __init__(self) -> None:
            self.n = 0

    with pytest.raises(TypeError, match="register_handler"):
        elastic.State(counter=Counter())
    elastic.register_handler(
        Counter, lambda c: {"n": c.n}, lambda c, saved: setattr(c, "n", saved["n"])
    )
    counter = Counter()
    state = elastic.State(counter=counter)
    counter.n = 3
    state.commit()
    counter.n = 9
    state.restore()
    assert counter.n == 3 and state.counter is counter


def test_random_state_replays_the_draws_of_a_step(torch_available):
    import random

    import torch

    from etcdrun import elastic

    state = elastic.State(rng=elastic.RandomState())
    torch.rand(3), random.random()  # draws before the commit are not replayed
    state.commit()
    first = (torch.rand(3), random.random())
    state.restore()
    again = (torch.rand(3), random.random())
    assert torch.equal(first[0], again[0]) and first[1] == again[1]
    assert not torch.equal(torch.rand(3), first[0])  # and the stream goes on from there


def test_the_elastic_sampler_deals_the_rest_of_the_epoch_to_the_world_it_runs_in(torch_available):
    from etcdrun import elastic

    sampler = elastic.ElasticSampler(20, shuffle=True, seed=3)
    order = sampler.order()
    assert sorted(order) == list(range(20))
    assert list(sampler)[:4] == order[:4]  # a world of one: the order itself
    sampler.record_batch(4)
    restored = elastic.ElasticSampler(20, shuffle=True, seed=3)
    restored.load_state_dict(sampler.state_dict())
    assert list(restored) == order[4:]
    restored.set_epoch(1)
    assert restored.consumed == 0 and restored.order() != order


SYNC = """
import os, sys
import torch, torch.distributed as dist
from etcdrun import elastic
from etcdrun.elastic import stream

stream.BUCKET_BYTES = 64  # small: tensors larger than a bucket are cut, small ones packed
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
torch.manual_seed(rank)  # every rank starts from another model
model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.BatchNorm1d(8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, 2)
extra = {"half": torch.arange(7, dtype=torch.bfloat16), "flag": torch.tensor(True),
         "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5, dtype=torch.float64)}
state = elastic.TorchState(model=model, optimizer=opt, scheduler=sched, step=0, extra=extra,
                           rng=elastic.RandomState())
for _ in range(3 if rank == 1 else 1):  # rank 1 has the newest commit
    model(torch.randn(4, 16)).sum().backward()
    opt.step(); sched.step(); opt.zero_grad()
    state.step += 1
    state.extra = {k: v + 1 if v.dtype != torch.bool else ~v for k, v in state.extra.items()}
    state.commit()
own_rng = torch.get_rng_state()
sent = state.sync()
flat = torch.cat([p.detach().reshape(-1) for p in model.state_dict().values()
                  if p.dtype.is_floating_point])
print("SYNC", rank, sent, state.step, sched.last_epoch, round(float(flat.sum()), 6),
      opt.state_dict()["state"][0]["step"].item(), state.extra["half"].tolist(),
      bool(state.extra["flag"]), torch.equal(torch.get_rng_state(), own_rng), flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "broken":  # the stream breaks halfway
    def breaks(saved, src, wait, device, reuse, bucket_bytes=None):
        for buf in reuse if dist.get_rank() != src else ():  # a receiver's, before the break
            buf.view(-1)[:1].fill_(7) if buf.numel() else None
        raise ConnectionError("the transport broke halfway")
    stream.broadcast = breaks
    state.commit()  # a commit of this rank's own, which the break must not spoil
    try:
        state.sync()
    except ConnectionError:
        live = state._live(True)
        kept = {n: state._shared.part(n, clone=False, place=False) for n in live}
        from etcdrun.elastic import agree
        print("BROKEN", rank, all(agree.equal(live[n], kept[n]) for n in live), flush=True)
    os._exit(0)
if len(sys.argv) > 1:  # a handler that loses a field: the replicas must not train on
    class Drift:
        def __init__(self): self.v = rank
    elastic.register_handler(Drift, lambda d: {"v": d.v}, lambda d, s: None)
    drifting = elastic.State(d=Drift())
    try:
        drifting.sync()
    except elastic.ReplicasDiverged as e:
        print("DIVERGED", rank, e, flush=True)
os._exit(0)  # past gloo's teardown: see _world
"""


SYNC_AFTER_DDP = """
import os
import torch, torch.distributed as dist
from etcdrun import elastic

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
torch.manual_seed(rank)
model = torch.nn.Linear(16, 8)
state = elastic.TorchState(model=model, step=0)
for _ in range(3 if rank == 1 else 1):  # rank 1 has the newest commit
    with torch.no_grad():
        model.weight.add_(1.0)
    state.step += 1
    state.commit()
newest = float(model.weight.sum()) if rank == 1 else None
# A re-form rebuilds DDP, whose constructor broadcasts rank 0's live parameters: the source's
# live state is then rank 0's, not its own commit.
model = torch.nn.parallel.DistributedDataParallel(model)
try:
    state.sync()
    print("SYNCED", rank, state.step, round(float(model.module.weight.sum()), 4), flush=True)
except elastic.ReplicasDiverged as e:
    print("DIVERGED", rank, e, flush=True)
if newest is not None:
    print("NEWEST", round(newest, 4), flush=True)
os._exit(0)  # past gloo's teardown: see _world
"""


def test_a_sync_after_ddp_broadcast_rank_0s_model_gives_every_rank_the_newest_commit(
    torch_available,
):
    """The in-place soak's seed 13241: a newcomer at node rank 0, a survivor with the newest
    commit at rank 1. The re-form's DDP rebuild broadcast rank 0's fresh model into the
    survivor, which took its live state for its commit, sent the commit, and then found itself
    diverged from it. The source now loads its own commit too.
    """
    outs = _world(SYNC_AFTER_DDP, 2)
    synced = sorted(ln for out in outs for ln in out.splitlines() if ln.startswith("SYNCED"))
    newest = [ln.split()[1] for out in outs for ln in out.splitlines() if ln.startswith("NEWEST")]
    assert len(synced) == 2 and len(newest) == 1, outs
    assert [ln.split()[2:] for ln in synced] == [["3", newest[0]]] * 2, outs


def _world(script: str, world: int, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """Run ``script`` as ``world`` gloo ranks; each one's stdout. The scripts end with
    ``os._exit(0)`` once their lines are out: torch 2.14.1's gloo sometimes aborts in the
    interpreter's teardown ("terminate called without an active exception", SIGABRT), with no
    etcdrun code in the process at all (4 of 80 processes of a plain gloo script of the same
    collectives; 2 of 90 of these scripts), which is not what these tests measure.
    """
    port = unused_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args],
            env=clean_env(
                RANK=str(r),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                **(env or {}),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
    return outs


def test_a_sync_streams_the_newest_commit_to_every_rank_without_numpy(torch_available):
    outs = _world(SYNC, 3, env={"PYTHONPATH": NO_NUMPY})
    lines = [
        ln.split(" ", 2)[2] for out in outs for ln in out.splitlines() if ln.startswith("SYNC")
    ]
    assert len(lines) == 3
    assert len(set(lines)) == 1, lines  # every rank holds rank 1's state, bit for bit
    sent, step, last_epoch, *_rest, own_rng = lines[0].split(" ")
    assert int(sent) > 0 and int(step) == 3 and int(last_epoch) == 3
    assert own_rng == "True", "a per-rank RandomState must stay the rank's own"


def test_replicas_that_part_fail_loudly(torch_available):
    outs = _world(SYNC, 2, "drift")
    diverged = [ln for out in outs for ln in out.splitlines() if ln.startswith("DIVERGED")]
    assert len(diverged) == 2 and all("d on rank(s) [1]" in ln for ln in diverged), outs


def test_a_sync_broken_halfway_leaves_each_rank_its_own_commit(torch_available):
    """A receiver takes the stream into its commit's buffers; broken halfway, they held part of
    its commit and part of the source's, and a later round could spread that mix as a commit.
    """
    outs = _world(SYNC, 2, "broken")
    said = [ln for o in outs for ln in o.splitlines() if ln.startswith("BROKEN")]
    assert sorted(said) == ["BROKEN 0 True", "BROKEN 1 True"], outs
