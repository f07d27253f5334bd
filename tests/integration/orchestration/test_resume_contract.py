"""The resume contract through `megatron-rl train` on CPU: a second start of a run with another batch shape is refused
before anything starts and writes nothing; one with another learning rate and more steps continues at the next step
with the new settings, recorded where they changed; `--fork` starts a new run from the first run's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _train  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.run]


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_resume_applies_or_refuses_a_changed_config_and_a_fork_starts_anew(tmp_path):
    constant = "trainer.optimizer.warmup_steps=0"  # train/lr is the configured rate from the first step
    first = _train(tmp_path, "r", ["total_steps=2", constant])
    lr = next(r["train/lr"] for r in first if "train/lr" in r)
    run_dir = tmp_path / "r"
    before = _snapshot(run_dir)

    refused = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "scalerl-cpu", f"output_dir={tmp_path}",
         "name=r", "total_steps=4", "rollout.prompts_per_step=4", f"trainer.optimizer.lr={2 * lr}", constant],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-3000:]
    line = refused.stderr.strip()
    assert "\n" not in line and "Traceback" not in refused.stderr, refused.stderr
    assert "rollout.prompts_per_step (16 -> 4)" in line or "rollout.prompts_per_step (8 -> 4)" in line, line
    assert "--fork" in line and "name=" in line and "trainer.optimizer.lr" not in line
    assert _snapshot(run_dir) == before  # nothing written: config, metrics, checkpoints, engine logs

    resumed = _train(tmp_path, "r", ["total_steps=4", f"trainer.optimizer.lr={2 * lr}", constant])
    steps = [r for r in resumed if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["train/lr"] for r in steps[2:]] == [2 * lr, 2 * lr] and steps[1]["train/lr"] == lr
    changes = [r for r in resumed if "config_change" in r]
    assert len(changes) == 1 and changes[0]["step"] == 2
    assert changes[0]["config_change"]["trainer.optimizer.lr"] == [lr, 2 * lr]
    assert changes[0]["config_change"]["total_steps"] == [2, 4]
    saved = json.loads((run_dir / "checkpoints" / "step_00000004" / "megatron_rl.json").read_text())
    assert saved["run"]["trainer"]["optimizer"]["lr"] == 2 * lr and saved["data_fingerprints"]

    forked = _train(tmp_path, "f", ["total_steps=2", "rollout.prompts_per_step=4"], fork=run_dir)
    steps = [r for r in forked if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    header = json.loads((tmp_path / "f" / "metrics.jsonl").read_text().splitlines()[0])["run"]
    assert header["forked_from"] == str(run_dir / "checkpoints" / "step_00000004")
    # the engines serve the forked weights the trainer holds: on-policy tokens agree as in any run's first step
    assert steps[0]["train/mismatch"] < 1e-3
    assert (tmp_path / "f" / "checkpoints" / "step_00000002").is_dir()
