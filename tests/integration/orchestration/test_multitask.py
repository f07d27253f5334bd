"""A math+code run on CPU through `megatron-rl train --recipe multitask-cpu`, then one scaling fit per task.

Real components throughout: SGLang on CPU, the megatron-core trainer, the bubblewrap sandbox running the
model's programs. Checks that every sample is rewarded by its own task, that per-task rewards, failure
reasons and validation pass rates are logged, and that `megatron-rl fit --metric 'val/pass_rate/*'` fits
one curve per task from the run's metrics file (or names the task it cannot fit).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from small_run import small_run

from megatron_rl.rewards.code import FAILURES

pytestmark = [pytest.mark.slow, pytest.mark.run]

OVERRIDES = small_run(
    "total_steps=5",
    "data.val_prompts=8",
    "eval.every_steps=1",
    "checkpoint.every_steps=100",
    "logging.wandb=offline",
)


def test_math_and_code_run_logs_per_task_curves_and_fits_each(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "multitask-cpu"]
    cmd += [f"output_dir={tmp_path}", "name=mt", *OVERRIDES]
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="offline")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    metrics = tmp_path / "mt" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()[1:]]

    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 5
    for task in ("math", "code"):  # both datasets feed the run (weights 1:1; a batch may hold one task only)
        seen = [r for r in steps if f"train/reward/{task}" in r]
        assert seen
        for r in seen:
            assert -1.0 <= r[f"train/reward/{task}"] <= 1.0 and 0.0 <= r[f"train/pass_rate/{task}"] <= 1.0
    for row in steps:
        # overall reward is the completions' mean over both tasks
        assert -1.0 <= row["train/reward"] <= 1.0
        failures = {k.removeprefix("train/failures/") for k in row if k.startswith("train/failures/")}
        assert failures <= set(FAILURES) | {"no_answer", "reward_error"}  # code's reasons and math's
        assert "reward_error" not in failures  # no reward function raised
        assert row["rollout/engine_failures"] == 0 and row["rollout/engine_retries"] == 0  # nothing injected

    # The warmed-up policy writes programs the sandbox runs and the tests accept.
    assert max(r.get("train/pass_rate/code", 0.0) for r in steps) > 0

    val = [r for r in rows if "val/pass_rate" in r]
    assert len(val) >= 6  # steps 0..4 and the final validation
    for row in val:
        assert 0.0 <= row["val/pass_rate/math"] <= 1.0 and 0.0 <= row["val/pass_rate/code"] <= 1.0
        # 8 held-out prompts per task, 2 samples each: the overall rate is the two tasks' mean
        assert row["val/pass_rate"] == pytest.approx((row["val/pass_rate/math"] + row["val/pass_rate/code"]) / 2)

    fits = tmp_path / "fits.json"
    cli = [sys.executable, "-m", "megatron_rl.cli", "fit", str(metrics), "--metric", "val/pass_rate/*"]
    cli += ["--bootstrap", "50", "--json", str(fits), "--plot", str(tmp_path / "tasks.png")]
    fit = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=300)
    # A task this short run cannot fit (at 1.0, or flat) is named under "failed" with exit 1; the other is fitted.
    assert fit.returncode in (0, 1), fit.stdout[-3000:] + fit.stderr[-3000:]
    assert (tmp_path / "tasks.png").stat().st_size > 0
    assert (tmp_path / "mt" / "scaling_curve_tasks.png").exists()  # the run's own final per-task fit
    payload = json.loads(fits.read_text())
    fitted = {entry["metric"]: entry for entry in payload["runs"].values()}
    failed = {entry["label"].rsplit(" ", 1)[-1] for entry in payload["failed"]}
    assert (fit.returncode == 1) == bool(failed)
    assert {m.rsplit("/", 1)[-1] for m in fitted} | failed == {"math", "code"}  # one curve per task
    assert not {m.rsplit("/", 1)[-1] for m in fitted} & failed
    for entry in fitted.values():
        assert 0.0 <= entry["A"] <= 1.0 and entry["B"] > 0 and entry["C_mid"] > 0
