"""`megatron-rl sweep` end to end on CPU: two real `scalerl-cpu` runs, the second stopped by the halving rule.

The sweep launches the runs one after the other as child processes of `megatron-rl train`. The first (`learns`)
trains 6 steps; the second (`mute`, which cannot answer: `MUTE`, 40 steps planned) is judged once it has 4
evaluations after R0. `learns` is then the leader, and the rule's margin of -1 makes the stop certain (two
asymptotes differ by more than -1 in every bootstrap draw):
what is checked is the machinery around it, with real processes: the SIGTERM the run answers with a checkpoint,
the reason and numbers in the state file, the report, the compute saved (recomputed here from the state), and a
second invocation that resumes from the state file and launches nothing. The rule's statistics are tested on
synthetic curves in tests/unit/scaling/test_sweep.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parents[1] / "orchestration"))
from small_run import small_run  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.run]

ROOT = Path(__file__).resolve().parents[3]
MUTE = {
    "rollout.interruption.min_thinking_tokens": 1,
    "rollout.interruption.max_thinking_tokens": 1,
    "rollout.interruption.lookahead_tokens": 0,
    "rollout.answer_tokens": 1,
    "algo.zero_variance_filter": False,
    "algo.truncated": "keep",
}
"""A run that cannot pass: one thinking token, then one answer token, where an answer is `\\boxed{...}` (8 tokens of
the tiny tokenizer). Its validation pass rate is 0, its fitted A at its lower bound (~0), so the run that learns is
the leader whatever the evaluation noise of 16 completions. Its completions are all cut short and its groups all
zero-variance, so both are trained on (zero advantages) for its steps to advance."""


def _sweep(path: Path, directory: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="offline", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "megatron_rl.cli", "sweep", str(path), "--dir", str(directory)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)


def test_a_sweep_stops_the_loser_and_resumes_without_relaunching(tmp_path):
    small = small_run(
        "eval.every_steps=1", "data.val_prompts=8", "rollout.prompts_per_step=4", "checkpoint.every_steps=100"
    )
    sweep = {
        "recipe": "scalerl-cpu",
        "overrides": small,
        "runs": [
            {"name": "learns", "overrides": {"total_steps": 6}},
            {"name": "mute", "overrides": {"total_steps": 40, **MUTE}},
        ],
        "launcher": {"kind": "local", "parallel": 1},
        "stopping": {"rule": "halving", "confidence": 0.9, "margin": -1.0, "min_evals": 4},
        "fit": {"bootstrap": 50, "min_points": 4},
        "poll_s": 1,
        "stop_grace_s": 120,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    directory = tmp_path / "sweep"
    done = _sweep(path, directory)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    state = json.loads((directory / "sweep_state.json").read_text())["runs"]
    learns, mute = state["learns"], state["mute"]
    assert learns["status"] == "finished" and learns["last_step"] == 6 and learns["exit_code"] == 0, learns
    assert mute["status"] == "stopped", (mute, done.stdout[-3000:])
    assert mute["stop"]["kind"] == "rule" and mute["stop"]["leader"] == "learns", mute["stop"]
    assert mute["stop"]["diff_lo"] > -1.0 and mute["stop"]["p_ahead"] == 1.0
    assert 4 <= mute["last_step"] < 40 and mute["exit_code"] == 0, mute
    # the stop was train's graceful one: it checkpointed the step it stopped at
    log = (directory / "logs" / "mute.log").read_text()
    assert f"stopped by SIGTERM at step {mute['last_step']}: checkpoint saved" in log, log[-3000:]
    assert (directory / "mute" / "checkpoints" / f"step_{mute['last_step']:08d}").is_dir()
    assert "mute: stop mute: leader learns" in done.stdout

    report = json.loads((directory / "report.json").read_text())
    per_step = mute["device_hours"] / mute["last_step"]
    projected = per_step * 40
    saved = report["compute_saved"]
    assert saved["stopped_used"] == pytest.approx(mute["device_hours"])
    assert saved["saved"] == pytest.approx(projected - mute["device_hours"])
    assert saved["grid_projected"] == pytest.approx(learns["device_hours"] + projected)
    assert saved["share"] == pytest.approx((projected - mute["device_hours"]) / (learns["device_hours"] + projected))
    assert (directory / "curves.png").stat().st_size > 10_000
    assert "| mute | stopped |" in (directory / "report.md").read_text()

    again = _sweep(path, directory)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    assert "learns: finished earlier" in again.stdout and "mute: stopped earlier" in again.stdout
    assert "launched" not in again.stdout.replace("not launched again", "")
    assert json.loads((directory / "sweep_state.json").read_text())["runs"]["mute"]["launches"] == 1
