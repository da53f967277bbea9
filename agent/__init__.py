"""etcdrun's node agent: the launcher API, the elastic loop, the worker runtime, the CLI.

The reference launcher's names, where its users look for them::

    from etcdrun.agent import LaunchConfig, elastic_launch, launch_agent, ChildFailedError, record

(``from etcdrun import ...`` gives the same objects.) Why they resolve lazily (PEP 562): this
package is imported before ``etcdrun --help`` and by every worker's ``from etcdrun import
record``; neither may pay for the launcher, and nothing here may load gRPC, protobuf or tenacity
(the etcd backend loads them when a handler is built).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - what the lazy names are, for type checkers and readers
    from etcdrun.agent.config import LaunchConfig
    from etcdrun.agent.errors import ChildFailedError, record
    from etcdrun.agent.launcher import elastic_launch, launch_agent

# The public name -> the module that defines it (the one table; etcdrun/__init__ reads it too).
EXPORTS = {
    "ChildFailedError": "etcdrun.agent.errors",
    "LaunchConfig": "etcdrun.agent.config",
    "elastic_launch": "etcdrun.agent.launcher",
    "launch_agent": "etcdrun.agent.launcher",
    "record": "etcdrun.agent.errors",
}

__all__ = ["ChildFailedError", "LaunchConfig", "elastic_launch", "launch_agent", "record"]


def __getattr__(name: str) -> Any:
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
