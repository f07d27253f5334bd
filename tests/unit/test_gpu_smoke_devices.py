"""tools/gpu_smoke.py's engine check gives its SGLang server the second device the check's process sees, named as
that process's CUDA_VISIBLE_DEVICES names it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_gpu_smoke():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "tools" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


engine_cuda_device = _load_gpu_smoke().engine_cuda_device


@pytest.mark.parametrize(
    ("visible", "count", "engine"),
    [
        (None, 2, "1"),  # every device of the machine
        (None, 8, "1"),
        ("4,5", 2, "5"),  # narrowed (a Slurm step's GPUs): its second device, not the machine's device 1
        ("6, 2,3", 3, "2"),
        ("GPU-8c1f,GPU-03aa", 2, "GPU-03aa"),  # named by UUID
        ("3,7,nonsense,1", 2, "7"),  # CUDA stops at the invalid entry: two devices
    ],
)
def test_the_engine_gets_the_second_visible_device(visible, count, engine):
    assert engine_cuda_device(visible, count) == engine


@pytest.mark.parametrize(("visible", "count"), [(None, 1), ("3", 1), ("", 0), (None, 0)])
def test_one_device_runs_no_engine_check(visible, count):
    assert engine_cuda_device(visible, count) is None  # NCCL refuses two ranks on one device
