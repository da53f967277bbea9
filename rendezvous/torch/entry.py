"""The object torchrun's ``torchrun.handlers`` entry point names: ``etcd-v3`` without torch here.

Why a module of its own, free of torch: torch loads every entry point of that group while its
``torch.distributed.elastic.rendezvous`` package is still being imported
(``registry._register_out_of_tree_handlers``), then *calls* the loaded object and registers what
the call returns as the creator ``f(RendezvousParameters) -> RendezvousHandler``. Had the entry
point named torch/plugin.py itself, a program that imports torch_plugin first would reach torch's
package half-way through its own import, torch would find the module without its creator yet, and
``etcd-v3`` would be missing (with a warning). Here the creator is a small function that imports
the plugin only when torchrun builds the handler, long after every import is done.
"""

from __future__ import annotations

from typing import Any

BACKEND = "etcd-v3"


def create_handler(params: Any) -> Any:
    """torch's ``RendezvousParameters`` -> the plugin's handler (torch's RendezvousHandler)."""
    from etcdrun.rendezvous.torch.plugin import create_handler as create

    return create(params)


def handler_creator() -> Any:
    """The entry point: torch calls it once and registers the creator it returns."""
    return create_handler


__all__ = ["BACKEND", "create_handler", "handler_creator"]
