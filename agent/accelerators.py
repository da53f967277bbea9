"""How many accelerators a node's workers can see, counted the way torchrun counts them, without
importing torch (``--nproc-per-node gpu|xpu|auto``).

Why not torch: ``etcdrun`` starts fast and its agent never loads torch, whose import alone costs
many times etcdrun's whole start (bench/results/figures.md). torch asks its
runtimes (CUDA/HIP, Level Zero); we read what the kernel drivers publish and apply the same
visibility variables the runtimes apply:

- ``gpu`` (torch.cuda): NVIDIA GPUs from ``/proc/driver/nvidia/gpus/*`` filtered by
  ``CUDA_VISIBLE_DEVICES``; else (a ROCm build of torch calls AMD GPUs "cuda") AMD GPUs from
  ``/sys/class/kfd/kfd/topology/nodes/*/properties`` (nodes with SIMDs), filtered by
  ``ROCR_VISIBLE_DEVICES`` and then ``HIP_VISIBLE_DEVICES`` (or ``CUDA_VISIBLE_DEVICES``);
- ``xpu`` (torch.xpu): Intel GPUs, ``/sys/class/drm/card<N>`` bound to the ``i915`` or ``xe``
  driver, one device per tile (``device/tile*`` for xe, ``gt/gt*`` for i915) as Level Zero's
  default ``ZE_FLAT_DEVICE_HIERARCHY=FLAT`` shows them (one per card with ``COMPOSITE`` or
  ``COMBINED``), filtered by ``ZE_AFFINITY_MASK`` or a ``level_zero:`` list in
  ``ONEAPI_DEVICE_SELECTOR``;
- ``auto``: GPUs, else XPUs, else the CPUs this process may run on (torch.accelerator first,
  then ``torch._utils.cpu_count``, i.e. ``sched_getaffinity``);
- ``cpu``: the CPUs this process may run on (``sched_getaffinity``: taskset and cgroups).

A privateuse1 backend's own name (torch_npu's ``npu``, ...) is not known without torch: give a
number. What was checked here: this machine has none of these devices (the counts are 0 and
the messages say so); the sysfs layouts are tested on fake trees (tests/agent/test_accelerators.py).
"""

from __future__ import annotations

import os
import re

ROOT = "/"  # where /proc and /sys are (tests point it at a fake tree)


def _path(*parts: str) -> str:
    return os.path.join(ROOT, *parts)


def _listdir(*parts: str) -> list[str]:
    try:
        return sorted(os.listdir(_path(*parts)))
    except OSError:
        return []


def _read(*parts: str) -> str:
    try:
        with open(_path(*parts)) as f:
            return f.read()
    except OSError:
        return ""


def _visible(value: str | None, present: int) -> int:
    """How many of ``present`` devices a ``*_VISIBLE_DEVICES`` list leaves (None: all).
    The runtimes stop at the first invalid entry (CUDA's rule; HIP's too).
    """
    if value is None:
        return present
    count = 0
    for item in value.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        count += 1
    return min(count, present)


def nvidia_count() -> int:
    present = len(_listdir("proc/driver/nvidia/gpus"))
    return _visible(os.environ.get("CUDA_VISIBLE_DEVICES"), present) if present else 0


def amd_count() -> int:
    nodes = "sys/class/kfd/kfd/topology/nodes"
    present = 0
    for node in _listdir(nodes):
        m = re.search(r"^simd_count\s+(\d+)", _read(nodes, node, "properties"), re.MULTILINE)
        if m and int(m.group(1)) > 0:  # CPU nodes have no SIMDs
            present += 1
    if not present:
        return 0
    count = _visible(os.environ.get("ROCR_VISIBLE_DEVICES"), present)
    hip = os.environ.get("HIP_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    return _visible(hip, count)


def gpu_count() -> int:
    """GPUs torch.cuda would count: NVIDIA's, else AMD's (a ROCm build)."""
    return nvidia_count() or amd_count()


def _intel_cards() -> list[str]:
    cards = []
    for name in _listdir("sys/class/drm"):
        if not re.fullmatch(r"card\d+", name):
            continue  # connectors (card0-DP-1), render nodes
        driver = os.path.basename(os.path.realpath(_path("sys/class/drm", name, "device/driver")))
        if driver in ("i915", "xe"):
            cards.append(name)
    return cards


def _tiles(card: str) -> int:
    xe = [t for t in _listdir("sys/class/drm", card, "device") if re.fullmatch(r"tile\d+", t)]
    i915 = [g for g in _listdir("sys/class/drm", card, "gt") if re.fullmatch(r"gt\d+", g)]
    return max(len(xe) or len(i915), 1)


def _level_zero_filter(present: int) -> int:
    mask = os.environ.get("ZE_AFFINITY_MASK")
    if mask is not None and mask.strip():
        roots = {item.strip().split(".")[0] for item in mask.split(",") if item.strip()}
        return min(len(roots), present)
    for part in os.environ.get("ONEAPI_DEVICE_SELECTOR", "").split(";"):
        backend, _, devices = (x.strip() for x in part.partition(":"))
        if backend.lstrip("!") != "level_zero":
            continue
        items = {d.strip().split(".")[0] for d in devices.split(",") if d.strip()}
        chosen = present if not items or not all(i.isdigit() for i in items) else len(items)
        chosen = min(chosen, present)
        return present - chosen if backend.startswith("!") else chosen
    return present


def xpu_count() -> int:
    """Intel GPUs torch.xpu would count (see the module docstring)."""
    cards = _intel_cards()
    if not cards:
        return 0
    hierarchy = os.environ.get("ZE_FLAT_DEVICE_HIERARCHY", "FLAT").strip().upper()
    per_card = [_tiles(c) if hierarchy == "FLAT" else 1 for c in cards]
    return _level_zero_filter(sum(per_card))


def cpu_count() -> int:
    """The CPUs this process may run on (torch._utils.cpu_count: sched_getaffinity)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def where_gpus() -> str:
    seen = [
        f"{v}={os.environ[v]}"
        for v in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
        if v in os.environ
    ]
    return "looked in /proc/driver/nvidia/gpus and /sys/class/kfd" + (
        f"; {', '.join(seen)}" if seen else ""
    )


def where_xpus() -> str:
    seen = [
        f"{v}={os.environ[v]}"
        for v in ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR", "ZE_FLAT_DEVICE_HIERARCHY")
        if v in os.environ
    ]
    return "looked in /sys/class/drm for i915/xe cards" + (f"; {', '.join(seen)}" if seen else "")


__all__ = ["cpu_count", "gpu_count", "where_gpus", "where_xpus", "xpu_count"]
