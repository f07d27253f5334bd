"""The resume contract (orchestration/resume.py): a start that finds a checkpoint applies the settings a user changes
mid-run, refuses the ones that make another experiment, and says how to start one instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import ConfigError, load_config, to_dict
from megatron_rl.metrics import MetricsLogger
from megatron_rl.orchestration.resume import check_data, check_resume, flatten, fork_source
from megatron_rl.scaling.curves import load_curve
from megatron_rl.trainer.checkpoint import write_manifest

BASE = ["name=r", "logging.wandb=disabled"]


def _checkpoint(root: Path, overrides: list[str], step: int = 20, recorded: bool = True) -> Path:
    """A run directory with one checkpoint saved under the config of `overrides` (recorded in its megatron_rl.json,
    or, as older checkpoints have it, only in the run directory's config.yaml)."""
    run = load_config("scalerl-cpu", None, BASE + overrides)
    path = root / "r" / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    meta = {"step": step, "data_fingerprints": {"synthetic:arithmetic": "abc"}}
    if recorded:
        meta["run"] = json.loads(json.dumps(to_dict(run)))
    (path / "megatron_rl.json").write_text(json.dumps(meta))
    for name in ("run_state.pt", "metadata.json"):  # what a complete checkpoint holds besides its shards
        (path / name).write_bytes(b"{}")
    write_manifest(path)
    (path.parent / "latest").write_text(path.name)
    (root / "r" / "config.yaml").write_text(yaml.safe_dump(to_dict(run)))
    return path


def _run(overrides: list[str]):
    return load_config("scalerl-cpu", None, BASE + overrides)


def test_flatten_names_every_field_of_listed_sections():
    flat = flatten(to_dict(_run([])))
    assert flat["trainer.optimizer.lr"] == _run([]).trainer.optimizer.lr
    assert flat["data.datasets.count"] == 1 and flat["data.datasets[0].source"] == "synthetic:arithmetic"


@pytest.mark.parametrize("recorded", [True, False])
def test_an_unchanged_config_resumes_silently(tmp_path, recorded):
    checkpoint = _checkpoint(tmp_path, ["total_steps=100"], recorded=recorded)
    assert check_resume(_run(["total_steps=100"]), checkpoint) is None


def test_learning_rate_steps_cadence_and_engines_are_applied_and_named(tmp_path):
    checkpoint = _checkpoint(tmp_path, ["total_steps=100"])
    now = _run(["total_steps=300", "trainer.optimizer.lr=2e-4", "eval.every_steps=5", "rollout.engine.num_engines=2"])
    change = check_resume(now, checkpoint)
    assert change is not None and change.step == 20
    assert set(change.fields) == {
        "total_steps",
        "trainer.optimizer.lr",
        "eval.every_steps",
        "rollout.engine.num_engines",
    }
    assert change.fields["total_steps"] == (100, 300)
    record = change.record()
    assert record["step"] == 20 and record["config_change"]["trainer.optimizer.lr"][1] == 2e-4
    assert "trainer.optimizer.lr" in change.describe()


@pytest.mark.parametrize(
    "override, field",
    [
        ("rollout.prompts_per_step=8", "rollout.prompts_per_step"),
        ("rollout.generations_per_prompt=4", "rollout.generations_per_prompt"),
        ("algo.loss=dapo", "algo.loss"),
        ("seed=7", "seed"),
        ("data.datasets=[{source: 'synthetic:arithmetic', val_prompts: 64}]", "data.datasets[0].val_prompts"),
        ("model.num_layers=2", "model.num_layers"),
        ("parallel.tp=2  parallel.trainer_devices=2", "parallel.tp"),
        ("trainer.params_dtype=bf16", "trainer.params_dtype"),
    ],
)
def test_another_experiment_is_refused_naming_the_fields_and_the_ways_out(tmp_path, override, field):
    checkpoint = _checkpoint(tmp_path, [])
    with pytest.raises(ConfigError) as refused:
        check_resume(_run([*override.split("  "), "trainer.optimizer.lr=2e-4"]), checkpoint)
    message = str(refused.value)
    assert field in message and "trainer.optimizer.lr" not in message  # the adjustable change is not the reason
    assert "name=" in message and f"--fork {tmp_path / 'r'}" in message and "\n" not in message


def test_a_fork_needs_only_the_same_model(tmp_path):
    checkpoint = _checkpoint(tmp_path, [])
    assert check_resume(_run(["rollout.prompts_per_step=8", "algo.loss=dapo", "seed=3"]), checkpoint, fork=True) is None
    with pytest.raises(ConfigError, match=r"--fork: .* another model .*model.num_layers"):
        check_resume(_run(["model.num_layers=2"]), checkpoint, fork=True)


def test_fork_source_takes_a_run_directory_or_a_checkpoint(tmp_path):
    checkpoint = _checkpoint(tmp_path, [])
    for given in (tmp_path / "r", checkpoint):
        assert fork_source(_run([f"checkpoint.fork_from={given}"])) == checkpoint
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        fork_source(_run([f"checkpoint.fork_from={tmp_path / 'nothing'}"]))


def test_data_changed_under_the_same_config_is_refused(tmp_path):
    checkpoint = _checkpoint(tmp_path, [])
    check_data({"synthetic:arithmetic": "abc"}, checkpoint)
    with pytest.raises(ConfigError, match=r"data.datasets: the prompts of synthetic:arithmetic changed"):
        check_data({"synthetic:arithmetic": "abd"}, checkpoint)


def test_a_config_change_is_recorded_once_and_marked_on_the_curve(tmp_path):
    logging = _run([]).logging
    logging.wandb = "disabled"
    logger = MetricsLogger(logging, tmp_path, {"name": "r"}, {})
    for step in (1, 2):
        logger.log(step, {"val/pass_rate": 0.1 * step, "device_hours": 0.5 * step})
    logger.close()
    record = {"step": 2, "config_change": {"trainer.optimizer.lr": [1e-4, 2e-4]}, "device_hours": 1.0}
    for _ in range(2):  # a start that applied the change died before its next checkpoint; the next applies it again
        logger = MetricsLogger(logging, tmp_path, {"name": "r"}, {}, resume_step=2)
        logger.mark(record)
        logger.close()
    logger = MetricsLogger(logging, tmp_path, {"name": "r"}, {}, resume_step=2)
    logger.log(3, {"val/pass_rate": 0.35, "device_hours": 1.5})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sum('"config_change"' in line for line in lines) == 1
    curve = load_curve(tmp_path / "metrics.jsonl")
    assert list(curve.R) == [0.1, 0.2, 0.35]
    assert curve.changes == [(1.0, 2, ["trainer.optimizer.lr"])]
    assert any("config changed at step 2" in note for note in curve.notes)


def test_a_forked_runs_restart_with_or_without_fork_is_not_a_change(tmp_path):
    checkpoint = _checkpoint(tmp_path, [f"checkpoint.fork_from={tmp_path / 'parent'}"])
    assert check_resume(_run([]), checkpoint) is None
