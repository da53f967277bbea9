"""etcdrun: an elastic launcher for multi-node PyTorch jobs whose rendezvous lives in etcd v3.

    from etcdrun import LaunchConfig, elastic_launch, launch_agent, ChildFailedError, record

    python -m etcdrun --nnodes 2:4 --nproc-per-node 2 --rdzv-backend etcd \\
        --rdzv-endpoint localhost:2379 --rdzv-id job1 train.py

Why this file sits in agent/_root/: the repository's layout is fixed (no ``etcdrun/`` folder), so
pyproject maps this folder onto the package ``etcdrun`` and agent/, rendezvous/, proto/ onto its
subpackages; editable installs and the wheel see the same package. Why the names resolve lazily
(PEP 562, from ``etcdrun.agent.EXPORTS``): ``import etcdrun`` runs before ``python -m etcdrun``
and in every worker that imports ``record``; it loads nothing but this file and etcdrun.agent's
(no gRPC, protobuf or tenacity).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from etcdrun.agent.config import LaunchConfig
    from etcdrun.agent.errors import ChildFailedError, record
    from etcdrun.agent.launcher import elastic_launch, launch_agent

__all__ = [
    "ChildFailedError",
    "LaunchConfig",
    "__version__",
    "elastic_launch",
    "launch_agent",
    "record",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from etcdrun.rendezvous._version import __version__

        return __version__
    agent = importlib.import_module("etcdrun.agent")
    if name not in agent.EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(agent, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
