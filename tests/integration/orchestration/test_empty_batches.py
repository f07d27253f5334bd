"""A run whose batches leave nothing to train on stops with the reason instead of sampling forever.

With `rewards.correct` equal to `rewards.incorrect` every group's rewards are equal, so the zero-variance
filter drops every group (as when a policy has collapsed to all-wrong answers): after
`algo.max_empty_batches` such batches in a row the run stops, exit status 1, naming the cause and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.run]


def test_a_run_with_only_zero_variance_groups_stops_with_the_reason(tmp_path):
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "scalerl-cpu", f"output_dir={tmp_path}"]
    command += ["name=empty", "rewards.correct=-1.0", "algo.max_empty_batches=3", "total_steps=10"]
    command += ["rollout.prompts_per_step=4", "rollout.generations_per_prompt=4", "data.val_prompts=8"]
    command += ["eval.samples_per_prompt=1", "eval.downstream.benchmarks=[]"]
    command += ["logging.wandb=disabled", "logging.live_scaling_fit=false"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-5000:]
    assert "3 batches in a row after step 0 had no group with differing rewards" in output, output[-5000:]
    assert "algo.max_empty_batches" in output
    rows = [json.loads(line) for line in (tmp_path / "empty" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert rows[-1]["train/empty_batches"] == 3.0
    assert not any("train/loss" in row for row in rows)
