"""``elastic.init_process_group``: the job's first default group, formed by etcdrun.

Why a function of etcdrun's rather than forming the group inside ``elastic.run``: the script
needs its group before ``elastic.run`` (its DDP model is built on it), and a release may shut
only what etcdrun created (group.py). So the script's first line changes from
``dist.init_process_group("gloo")`` to ``elastic.init_process_group("gloo")``; every round's
group after it is formed the same way, and the worker's one ``Group`` knows each socket it may
shut. ``dist.init_process_group`` keeps working: its group is adopted and never shut, with the
limit group.py states.

Why the version gate: telling the transport's failures from the script's needs torch 2.14's
collective post-hooks (origin.py). On an older torch, ``elastic.run`` says so in one line and
runs the training once, as under torchrun: the agent then restarts the workers at a membership
change, as for any script that does not opt in.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

from etcdrun.agent.worker.control import VAR
from etcdrun.elastic.group import Group

log = logging.getLogger("etcdrun.elastic")
NEEDS = (2, 14)  # torch's ProcessGroup.register_post_hook
_group: Group | None = None


def worker_group() -> Group:
    """This process's one ``Group``, made on first use."""
    global _group
    if _group is None:
        _group = Group()
    return _group


def under_agent() -> bool:
    """Whether an etcdrun agent started this process (its control channel is named)."""
    return bool(os.environ.get(VAR))


def supported() -> bool:
    """Whether this torch has what in place needs (``NEEDS``)."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= NEEDS


def default_backend() -> str:
    return "nccl" if os.environ.get("CUDA_VISIBLE_DEVICES") not in (None, "") else "gloo"


def init_process_group(backend: str | None = None, timeout: timedelta | None = None) -> None:
    """Form the default process group of this round (env:// as torchrun's: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), as etcdrun's own, so that ``elastic.run`` can release it at a
    membership change without touching anything else of the process. ``backend``: "gloo",
    "nccl" (None: NCCL when ``CUDA_VISIBLE_DEVICES`` names a GPU, else gloo); ``timeout``:
    the collectives' (torch's default when None). Outside an etcdrun agent, or on a torch
    older than 2.14, it is ``torch.distributed.init_process_group(backend, timeout=timeout)``.
    """
    import torch.distributed as dist

    if not under_agent() or not supported():
        dist.init_process_group(backend, timeout=timeout)
        return
    group = worker_group()
    group.form(backend or default_backend(), timeout=timeout)
    group.check_round()


def group_for_run() -> tuple[Group, Any]:
    """The group ``elastic.run`` works with: the one ``init_process_group`` formed, or the
    script's own adopted; and the backend of later rounds' groups.
    """
    import torch.distributed as dist

    group = worker_group()
    if not dist.is_initialized():
        return group, default_backend()
    backend = dist.get_backend()
    if not group.owned:
        group.adopt()
        if backend == "nccl":
            log.warning(
                "etcdrun.elastic: rank %s: the NCCL group this script formed is its own, and "
                "etcdrun aborts only groups it formed: until the first membership change, a "
                "collective blocked on a lost peer waits for NCCL's timeout (form the group "
                "with etcdrun.elastic.init_process_group)",
                os.environ.get("RANK", "?"),
            )
    return group, backend


__all__ = ["init_process_group", "supported", "under_agent", "worker_group"]
