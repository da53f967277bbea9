"""Handlers: how each kind of value a ``State`` holds is saved and loaded (Horovod's shape).

Why by type, and why not a deep copy: a value is either an *object* the script keeps using (a
module, an optimizer, an LR scheduler bound to that optimizer, a sampler) or a plain *value*
(a step, an epoch, a list of losses). An object must be loaded in place, so that every
reference the script holds stays valid; a deep copy of an LR scheduler copies its optimizer
too, and the restored scheduler then drives a copy nobody trains with (the newcomer of the
OneCycleLR case trained at a fresh schedule's first rate while the survivors were far along it,
and the replicas parted without an error). So each value gets the handler registered for the
nearest class in its MRO; anything with torch's ``Stateful`` protocol (``state_dict`` and
``load_state_dict``: schedulers, ``GradScaler``, samplers and loaders that keep a position) is
an object by that protocol; plain Python values and tensors are values; anything else is
refused when the state is built, naming ``register_handler`` as the remedy, rather than copied
in a way that breaks it at the first membership change.

What a handler's ``save`` returns is a *tree*: dicts, lists and tuples whose leaves are tensors
or plain values. It may hand out the live tensors (a module's ``state_dict()`` does): the state
copies them to the host at a commit (snapshot.py). ``load`` receives a tree of tensors the
state owns no longer, fresh for that call, unless the handler says it copies them itself
(``copies``: ``load_state_dict`` of a module copies into its parameters, so no clone is made).
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import fractions
import pathlib
from collections.abc import Callable
from typing import Any

Save = Callable[[Any], Any]
Load = Callable[[Any, Any], None]

# Loaded in this order: a scheduler's or a sampler's state can refer to the optimizer's (its
# param groups' learning rates) and must come after it; values and user handlers come last.
MODULE, OPTIMIZER, OBJECT = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Handler:
    """How one kind of object is kept: ``save(obj) -> tree``, ``load(obj, tree)``.

    ``per_rank``: the object's state belongs to its rank (a random generator that gives each
    rank its own dropout): it is kept through commit and restore, but ``sync()`` never sends
    it and the agreement check leaves it out. A bool, or a function of the object when its
    instances differ (``RandomState(per_rank=False)``). ``copies``: ``load`` copies the tree's
    tensors into the object, so the state may hand it its own. ``order``: MODULE, OPTIMIZER
    or OBJECT.
    """

    save: Save
    load: Load
    order: int = OBJECT
    per_rank: bool | Callable[[Any], bool] = False
    copies: bool = False

    def kept_per_rank(self, obj: Any) -> bool:
        return self.per_rank(obj) if callable(self.per_rank) else self.per_rank


_registry: dict[type, Handler] = {}


def register_handler(
    kind: type, save: Save, load: Load, *, per_rank: bool | Callable[[Any], bool] = False
) -> None:
    """Keep values of ``kind`` (and its subclasses) with ``save(obj) -> tree`` and
    ``load(obj, tree)``: a tree is dicts, lists and tuples of tensors and plain values, and
    ``load`` must put the saved state into ``obj`` in place. ``per_rank`` (or a function of
    the object that says it): this rank's own state, never sent by ``sync()``. A later
    registration for the same type replaces the earlier one; the nearest registered class in
    a value's MRO wins.
    """
    if not isinstance(kind, type):
        raise TypeError(f"register_handler: {kind!r} is not a type")
    _registry[kind] = Handler(save, load, per_rank=per_rank)


def handler_for(value: Any) -> Handler | None:
    """The handler of an object, or None for a plain value (which is copied as a whole).
    Raises TypeError for a value that is neither, naming the remedy.
    """
    _builtins()
    for kind in type(value).__mro__:
        if kind in _registry:
            return _registry[kind]
    if _stateful(value):
        return _STATEFUL
    if is_plain(value):
        return None
    raise TypeError(
        f"etcdrun.elastic cannot keep a {type(value).__module__}.{type(value).__qualname__}: "
        "it is not a tensor, a plain value or an object with state_dict()/load_state_dict(); "
        "register how with etcdrun.elastic.register_handler(type, save, load)"
    )


_PLAIN_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    datetime.date,
    datetime.time,
    datetime.timedelta,
    decimal.Decimal,
    fractions.Fraction,
    pathlib.PurePath,
)


def is_plain(value: Any) -> bool:
    """Whether ``value`` is a plain value: Python's atoms, tensors, and lists, tuples, sets and
    dicts of them. A copy of a plain value refers to nothing the script keeps using.
    """
    import torch

    if isinstance(value, (*_PLAIN_ATOMS, torch.Tensor)):
        return True
    if isinstance(value, list | tuple | set | frozenset):
        return all(is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(is_plain(k) and is_plain(v) for k, v in value.items())
    return False


def _stateful(value: Any) -> bool:
    from torch.distributed.checkpoint.stateful import Stateful

    return isinstance(value, Stateful)


def _load_module(module: Any, tree: Any) -> None:
    module.load_state_dict(tree)


def _load_optimizer(optimizer: Any, tree: Any) -> None:
    """Into the live state tensors when the saved state has their layout (the usual case: the
    same model, a commit of this run), else by ``load_state_dict`` on a copy of the tree.

    Why in place: ``load_state_dict`` keeps the tensors it is given, so the state had to hand
    it clones (Adam's state is twice the model: 680 MB more at the peak of a 1 GB restore,
    bench/results/state_sync.md), and a copy into tensors that exist needs no memory at all.
    """
    if not _load_optimizer_in_place(optimizer, tree):
        optimizer.load_state_dict(_cloned(tree))
    optimizer.zero_grad(set_to_none=True)  # a step cut short left its gradients


def _load_optimizer_in_place(optimizer: Any, tree: Any) -> bool:
    """Copy ``tree`` (an optimizer's ``state_dict()``) into ``optimizer``'s live state; False,
    with nothing changed, when the layouts differ (other params, keys, shapes or types).
    """
    import torch

    groups = tree.get("param_groups") if isinstance(tree, dict) else None
    saved = tree.get("state") if isinstance(tree, dict) else None
    live_groups = optimizer.param_groups
    if not isinstance(groups, list) or not isinstance(saved, dict):
        return False
    if len(groups) != len(live_groups):
        return False
    params = [p for g in live_groups for p in g["params"]]
    if [i for g in groups for i in g.get("params", ())] != list(range(len(params))):
        return False
    pairs = []
    for index, p in enumerate(params):
        want, have = saved.get(index, {}), optimizer.state.get(p, {})
        if set(want) != set(have):
            return False
        for key, value in want.items():
            live = have[key]
            if isinstance(value, torch.Tensor) != isinstance(live, torch.Tensor):
                return False
            if isinstance(value, torch.Tensor):
                if value.shape != live.shape:
                    return False
                pairs.append((live, value))
            elif value != live:
                pairs.append((have, (key, value)))
    with torch.no_grad():
        for live, value in pairs:
            if isinstance(live, torch.Tensor):
                live.copy_(value)
            else:
                live[value[0]] = value[1]
    for group, want in zip(live_groups, groups, strict=True):
        for key, value in want.items():
            if key != "params":
                group[key] = value
    return True


def _cloned(tree: Any) -> Any:
    """``tree`` with its tensors cloned (what ``load_state_dict`` may keep)."""
    from etcdrun.elastic.snapshot import flatten, unflatten

    skeleton, leaves = flatten(tree)
    return unflatten(skeleton, [t.clone() for t in leaves])


def _load_stateful(obj: Any, tree: Any) -> None:
    obj.load_state_dict(tree)


def _save_generator(gen: Any) -> Any:
    return gen.get_state()


def _load_generator(gen: Any, tree: Any) -> None:
    gen.set_state(tree)


_STATEFUL = Handler(lambda obj: obj.state_dict(), _load_stateful)
_loaded = False


def _builtins() -> None:
    """Register torch's kinds once torch is imported (importing etcdrun.elastic costs nothing
    until a state is built). A user's registration for the same type, made earlier, wins.
    """
    global _loaded
    if _loaded:
        return
    import torch

    _loaded = True
    builtin = {
        torch.nn.Module: Handler(lambda m: m.state_dict(), _load_module, order=MODULE, copies=True),
        torch.optim.Optimizer: Handler(
            lambda o: o.state_dict(), _load_optimizer, order=OPTIMIZER, copies=True
        ),
        # a torch.Generator given as a value is the script's own stream: kept per rank
        torch.Generator: Handler(_save_generator, _load_generator, per_rank=True),
    }
    for kind, handler in builtin.items():
        _registry.setdefault(kind, handler)


__all__ = ["MODULE", "OBJECT", "OPTIMIZER", "Handler", "handler_for", "register_handler"]
