"""DDP models across re-forms: rebuilt in place on each new group, their all-reduces releasable.

Why rebuilt, and why fresh rather than ``_update_process_group``: survivors and newcomers must
run the same collectives in the same order. A newcomer's script builds its DDP model on the new
group, and the constructor runs collectives (parameter shapes, module states from rank 0); a
survivor that builds its wrapper anew runs the same ones. The reducer's state comes fresh with
it: a reset reducer that remembered its first iteration rebuilt its buckets one iteration
before a newcomer's did, a broadcast met an allreduce, and the gradients of that step were
wrong (tests/pytorch/test_in_place.py, "arrive"). The fresh wrapper's attributes replace the
old wrapper's, so the script's reference to it stays valid; the old reducer goes with the old
attributes, its autograd hooks with it.

What the fresh wrapper is built with: the constructor's arguments as the wrapper exposes them
(``device_ids``, ``output_device``, ``dim``, ``bucket_bytes_cap``, ``find_unused_parameters``,
``gradient_as_bucket_view``, ``static_graph``, ``forward_sync_buffers``,
``skip_all_reduce_unused_params``, ``mixed_precision``, ``batched_grad_copy``). The script's
hooks are read from the wrapper's ``_comm_hooks``, the one private field read: torch lists a
model's hooks nowhere else. The script's own communication hooks are registered again on it, as a
newcomer's script registers them: survivors and newcomers then reduce gradients the same way
(a hook of another kind, PowerSGD say, runs other collectives). A hook's state that names the
old process group itself, rather than None for the default one, would still name it: the limit
of carrying a hook over. etcdrun's own hook (inflight.py) is not carried: ``attach`` gives the
fresh wrapper one of the new group's.
"""

from __future__ import annotations

from typing import Any

from etcdrun.elastic.inflight import InFlight


def rewrap(model: Any) -> None:
    """Rebuild ``model`` in place on the default group, when it is a DDP model."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return
    scripts = [(h, s) for h, s in model._comm_hooks if not isinstance(s, InFlight)]
    fresh = DistributedDataParallel(
        model.module,
        device_ids=model.device_ids,
        output_device=model.output_device,
        dim=model.dim,
        bucket_cap_mb=model.bucket_bytes_cap / (1024 * 1024),
        find_unused_parameters=model.find_unused_parameters,
        gradient_as_bucket_view=model.gradient_as_bucket_view,
        static_graph=model.static_graph,
        forward_sync_buffers=model.forward_sync_buffers,
        skip_all_reduce_unused_params=model.skip_all_reduce_unused_params,
        mixed_precision=model.mixed_precision,
        batched_grad_copy=model.batched_grad_copy,
    )
    own = [h for h, _ in fresh._comm_hooks]  # DDP's own (mixed precision's) come anew
    model.__dict__.update(fresh.__dict__)
    for hook, hook_state in scripts:
        if hook not in own:
            model.register_comm_hook(hook_state, hook)


def attach(model: Any, inflight: InFlight) -> None:
    """Route a DDP model's all-reduces through ``inflight``, so that a release ends them."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        inflight.hook(model)


__all__ = ["attach", "rewrap"]
