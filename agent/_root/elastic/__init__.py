"""etcdrun.elastic: training whose processes and memory survive a membership change.

Horovod's shape, on etcdrun's rounds::

    state = elastic.TorchState(model=model, optimizer=opt, step=0)

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
the rank with the newest commit (``sync()``), run the ``on_reset`` callbacks and call ``train``
again. A newcomer receives the state from a survivor, not from a checkpoint. An exception of the
script's own is a failure, as without this module. Outside an etcdrun agent (plain torchrun, a
bare ``python``) ``run`` calls the function once: a restart is the launcher's.

A script that does not opt in can still feed the agent's hang watchdog (``--hang-timeout``):
``elastic.progress(step)`` once per step; ``commit()`` does it for those that do.

torch is imported where it is used, so that importing this package costs nothing until then.
"""

from __future__ import annotations

from etcdrun.elastic.progress import progress
from etcdrun.elastic.runner import MembershipChanged, run
from etcdrun.elastic.state import State, TorchState

__all__ = ["MembershipChanged", "State", "TorchState", "progress", "run"]
