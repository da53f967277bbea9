"""etcdrun.elastic: training whose processes and memory survive a membership change.

Horovod's shape, on etcdrun's rounds::

    elastic.init_process_group("gloo")          # etcdrun's group: see process_group.py
    model = DistributedDataParallel(net)
    state = elastic.TorchState(model=model, optimizer=opt, scheduler=sched, step=0)

    @elastic.run
    def train(state):
        while state.step < total_steps:
            ...one step...
            state.step += 1
            state.commit()

    train(state)

When a node dies, leaves or arrives, the workers that entered ``elastic.run`` are not stopped:
their agent tells them the round is over (a collective blocked on a lost peer is released at
once), they go back to the last ``commit()``, re-form the default process group for the new
round (new RANK, WORLD_SIZE, MASTER_*, also in ``os.environ``), re-sync DDP, take the state of
the rank with the newest commit (``sync()``, streamed tensor by tensor), check that every rank
holds the same state, run the ``on_reset`` callbacks and call ``train`` again. A newcomer
receives the state from a survivor, not from a checkpoint. Each value of the state is kept by
the handler of its type (modules, optimizers, LR schedulers, samplers, ``RandomState``, plain
values; ``register_handler`` for the rest). An exception of the script's own is a failure, as
without this module. Outside an etcdrun agent (plain torchrun, a bare ``python``) ``run``
calls the function once: a restart is the launcher's.

A script that does not opt in can still feed the agent's hang watchdog (``--hang-timeout``):
``elastic.progress(step)`` once per step; ``commit()`` does it for those that do.

torch is imported where it is used, so that importing this package costs nothing until then.
"""

from __future__ import annotations

from etcdrun.elastic.agree import ReplicasDiverged
from etcdrun.elastic.handlers import register_handler
from etcdrun.elastic.process_group import init_process_group
from etcdrun.elastic.progress import progress
from etcdrun.elastic.rng import RandomState
from etcdrun.elastic.runner import MembershipChanged, run
from etcdrun.elastic.sampler import ElasticSampler
from etcdrun.elastic.state import State, TorchState

__all__ = [
    "ElasticSampler",
    "MembershipChanged",
    "RandomState",
    "ReplicasDiverged",
    "State",
    "TorchState",
    "init_process_group",
    "progress",
    "register_handler",
    "run",
]
