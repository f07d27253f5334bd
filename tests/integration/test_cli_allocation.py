"""`check --allocation` / `plan --allocation`: the recipe's GPU split against NODESxGPUS_PER_NODE, before anything
starts (slurm/bootstrap.sh runs it with the Slurm allocation)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_bootstrap_without_a_gpu_count_refuses_a_gpu_run_before_ray_starts(tmp_path):
    """slurm/bootstrap.sh outside a GPU allocation (no SLURM_GPUS_ON_NODE, no GPUS_PER_NODE): it says so, and the
    allocation check refuses the GPU recipe with exit 2 before any `ray start` (a fake scontrol gives 2 nodes)."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\nprintf 'node1\\nnode2\\n'\n")
    (tmp_path / "srun").write_text("#!/bin/sh\necho srun called >&2\nexit 99\n")
    for tool in ("scontrol", "srun"):
        (tmp_path / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_GPUS_ON_NODE", "GPUS_PER_NODE")}
    env.update(PATH=f"{tmp_path}:{env['PATH']}", RECIPE="scalerl", MODEL="llama3_8b", OUTPUT_DIR=str(tmp_path),
               MRL=str(Path(sys.executable).parent / "megatron-rl"), PYTHONWARNINGS="ignore")  # fmt: skip
    result = subprocess.run(["bash", str(ROOT / "slurm" / "bootstrap.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "neither SLURM_GPUS_ON_NODE (set by sbatch --gpus-per-node=N) nor GPUS_PER_NODE is set" in result.stderr
    assert "--allocation 2x0: 0 GPUs per node; this GPU run needs at least 1" in result.stderr
    assert "srun called" not in result.stderr


def test_a_gpu_run_without_a_checkpoint_is_refused_by_check_and_train_before_anything_starts(tmp_path):
    """`sbatch slurm/scalerl_dense.sh` without MODEL_PATH: the check the bootstrap runs first says which field to set
    (it used to pass, bring Ray up, and start RL from a random 8B model); a directory that is not a checkpoint of the
    model is refused too (tests/unit/test_check_checkpoint.py)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cli = [sys.executable, "-m", "megatron_rl.cli"]
    for command in ("check", "train"):
        refused = subprocess.run([*cli, command, "--model", "llama3_8b"], capture_output=True, text=True, env=env)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "model.hf_path: a GPU run starts RL from a pretrained Hugging Face checkpoint" in refused.stderr
        assert "MODEL_PATH=" in refused.stderr and "Traceback" not in refused.stderr
    missing = subprocess.run(
        [*cli, "check", "--model", "llama3_8b", f"model.hf_path={tmp_path}"], capture_output=True, text=True, env=env
    )
    assert missing.returncode == 2 and f"model.hf_path: {tmp_path} has no config.json" in missing.stderr
    (tmp_path / "config.json").write_text("{}")  # a directory that only looks like a checkpoint
    empty = subprocess.run(
        [*cli, "check", "--model", "llama3_8b", f"model.hf_path={tmp_path}"], capture_output=True, text=True, env=env
    )
    assert empty.returncode == 2 and "model.hf_path: config.json: unknown architecture" in empty.stderr, empty.stderr
    assert subprocess.run([*cli, "check", "--recipe", "scalerl-cpu"], capture_output=True, env=env).returncode == 0
