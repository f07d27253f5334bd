"""`megatron-rl node-check` (slurm/bootstrap.sh runs it on every GPU node before Ray): a driver too old for the
image's CUDA, GPUs smaller or fewer than planned, or no driver at all, each in one line with the numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.orchestration import node_check

ROOT = Path(__file__).parents[3]


def _node(tmp_path: Path, rows: list[str] | None, *args: str) -> subprocess.CompletedProcess:
    """node-check against a fake nvidia-smi printing `rows` (None: no nvidia-smi on the PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    path = f"{bin_dir}:/usr/bin:/bin"
    if rows is not None:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nprintf '" + "\\n".join(rows) + "\\n'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=path, PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "megatron_rl.cli", "node-check", "--model", "llama3_8b", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


H100 = "580.65.06, 81559"


def test_a_fit_node_passes_in_one_line(tmp_path):
    done = _node(tmp_path, [H100] * 8, "--gpus", "8")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(
        r"node-check: \S+: driver 580.65.06 \(CUDA 13.0 needs >= 580\), 8 x 79.6 GiB: ok\n", done.stdout
    )


@pytest.mark.parametrize(
    ("rows", "args", "reason"),
    [
        (["550.54.15, 81559"] * 8, [], "NVIDIA driver 550.54.15 cannot run the image's CUDA 13.0 (needs >= 580"),
        (["580.65.06, 40960"] * 8, [], "GPUs of 40.0 GiB, the run is planned for 79.6 GiB (compute.device_memory_gib"),
        ([H100] * 4, ["--gpus", "8"], "4 GPUs visible, the allocation gives 8 per node"),
        (None, [], "no NVIDIA driver on this node (nvidia-smi not found)"),
    ],
    ids=["old-driver", "small-gpu", "missing-gpus", "no-driver"],
)
def test_an_unfit_node_is_refused_with_the_reason_and_numbers(tmp_path, rows, args, reason):
    done = _node(tmp_path, rows, *args)
    assert done.returncode == 2 and reason in done.stderr, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_the_image_cuda_is_the_one_the_check_knows():
    base = re.search(r"^FROM nvidia/cuda:(\d+\.\d+)", (ROOT / "env" / "Dockerfile").read_text(), re.M).group(1)
    assert base == node_check.IMAGE_CUDA
    assert '--gpus "$gpus_per_node"' in (ROOT / "slurm" / "bootstrap.sh").read_text()


def test_trainer_ranks_run_with_expandable_segments(monkeypatch):
    """Set before the rank's first CUDA allocation (the Trainer is built after it); a site's own setting stays."""
    import dataclasses

    import megatron_rl.trainer.step as step
    from megatron_rl.config import load_config
    from megatron_rl.orchestration.actors import TrainerWorker

    seen = []
    monkeypatch.setattr(step, "Trainer", lambda run: seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_NVLS_ENABLE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    run = dataclasses.asdict(load_config("scalerl-cpu"))
    TrainerWorker().setup(run, 0, 1, "127.0.0.1", 29500)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    TrainerWorker().setup(run, 0, 1, "127.0.0.1", 29500)
    assert seen == ["expandable_segments:True", "max_split_size_mb:512"]
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # NVLink SHARP's buffers off, as the plan counts them


def test_a_node_whose_transformer_engine_does_not_import_is_refused(tmp_path):
    """The image's Transformer Engine binding built against another torch: named by the node check, before Ray."""
    package = tmp_path / "site" / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text("raise ImportError('undefined symbol: _ZN3c10')\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{H100}\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", PYTHONPATH=str(tmp_path / "site"), PYTHONWARNINGS="ignore")
    command = [sys.executable, "-m", "megatron_rl.cli", "node-check", "--model", "llama3_8b"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Transformer Engine is installed but does not import (ImportError: undefined symbol: _ZN3c10)" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
