"""--nproc-per-node gpu|xpu|auto|cpu: accelerators counted as torchrun counts them, without torch.

The sysfs and procfs layouts are built as fake trees (this machine has no GPU or XPU); the
counts under the visibility variables are the runtimes' rules (CUDA, HIP/ROCr, Level Zero).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from etcdrun.agent import accelerators as acc
from etcdrun.agent.flags import UsageError, parse_nproc

VARS = (
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "ZE_AFFINITY_MASK",
    "ONEAPI_DEVICE_SELECTOR",
    "ZE_FLAT_DEVICE_HIERARCHY",
)


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(acc, "ROOT", str(tmp_path))
    return tmp_path


def nvidia(root: Path, n: int) -> None:
    for i in range(n):
        (root / f"proc/driver/nvidia/gpus/0000:{i:02x}:00.0").mkdir(parents=True)


def amd(root: Path, gpus: int, cpus: int = 1) -> None:
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    for i in range(cpus + gpus):
        (nodes / str(i)).mkdir(parents=True)
        simds = 0 if i < cpus else 304
        (nodes / str(i) / "properties").write_text(f"cpu_cores_count 8\nsimd_count {simds}\n")


def intel(root: Path, card: int, driver: str, tiles: int = 1) -> None:
    drm = root / "sys/class/drm"
    dev = root / f"sys/devices/pci0000:00/0000:{card:02x}:00.0"
    drivers = root / "sys/bus/pci/drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    dev.mkdir(parents=True)
    (dev / "driver").symlink_to(drivers)
    drm.mkdir(parents=True, exist_ok=True)
    (drm / f"card{card}").mkdir()
    (drm / f"card{card}" / "device").symlink_to(dev)
    (drm / f"card{card}-DP-1").mkdir()  # a connector, not a card
    for t in range(tiles):
        if driver == "xe":
            (dev / f"tile{t}").mkdir()
        else:
            (drm / f"card{card}" / "gt" / f"gt{t}").mkdir(parents=True)


def test_nothing_visible_is_said_plainly(root):
    assert (acc.gpu_count(), acc.xpu_count()) == (0, 0)
    with pytest.raises(UsageError, match="gpu: no GPU is visible on this node .looked in /proc"):
        parse_nproc("gpu")
    with pytest.raises(UsageError, match=r"xpu: no Intel GPU \(XPU\) is visible on this node"):
        parse_nproc("xpu")
    assert parse_nproc("auto") == parse_nproc("cpu") == len(os.sched_getaffinity(0))


def test_nvidia_and_cuda_visible_devices(root, monkeypatch):
    nvidia(root, 4)
    assert parse_nproc("gpu") == parse_nproc("auto") == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert acc.gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,-1,2")  # CUDA stops at the first invalid one
    assert acc.gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert acc.gpu_count() == 0
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES="):
        parse_nproc("gpu")


def test_amd_gpus_count_as_gpu_for_a_rocm_torch(root, monkeypatch):
    amd(root, gpus=8, cpus=2)
    assert parse_nproc("gpu") == 8
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1,2,3")
    assert acc.gpu_count() == 4
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "3")
    assert acc.gpu_count() == 1


def test_intel_xpus_one_per_tile_by_default(root, monkeypatch):
    intel(root, 0, "xe", tiles=2)
    intel(root, 1, "i915", tiles=2)
    intel(root, 2, "i915")
    assert parse_nproc("xpu") == 5 and parse_nproc("auto") == 5 and acc.gpu_count() == 0
    monkeypatch.setenv("ZE_FLAT_DEVICE_HIERARCHY", "COMPOSITE")
    assert acc.xpu_count() == 3
    monkeypatch.delenv("ZE_FLAT_DEVICE_HIERARCHY")
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0,3")
    assert acc.xpu_count() == 2
    monkeypatch.delenv("ZE_AFFINITY_MASK")
    monkeypatch.setenv("ONEAPI_DEVICE_SELECTOR", "level_zero:1")
    assert acc.xpu_count() == 1
    monkeypatch.setenv("ONEAPI_DEVICE_SELECTOR", "level_zero:*")
    assert acc.xpu_count() == 5
    monkeypatch.setenv("ONEAPI_DEVICE_SELECTOR", "!level_zero:*")
    assert acc.xpu_count() == 0


def test_other_drivers_are_no_xpu(root):
    intel(root, 0, "amdgpu")
    assert acc.xpu_count() == 0


def test_gpu_wins_over_xpu_for_auto(root):
    nvidia(root, 2)
    intel(root, 0, "xe")
    assert parse_nproc("auto") == 2 and parse_nproc("xpu") == 1


def test_cpu_is_the_cpus_this_process_may_use(root):
    allowed = os.sched_getaffinity(0)
    one = {min(allowed)}
    os.sched_setaffinity(0, one)
    try:
        assert parse_nproc("cpu") == 1  # taskset -c N etcdrun ...: torch's cpu_count
    finally:
        os.sched_setaffinity(0, allowed)


def test_another_accelerators_name_asks_for_a_number(root):
    with pytest.raises(UsageError, match="'npu': expected an integer, cpu, gpu, xpu or auto"):
        parse_nproc("npu")
