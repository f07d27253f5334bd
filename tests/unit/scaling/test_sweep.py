"""The sweep file (grid, validation), its metrics reader, the stopping rule on synthetic curves, and the compute the
stops save, checked by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_rl.scaling.launchers import parse_job, sbatch_command, train_command
from megatron_rl.scaling.sweep import (
    FitSettings,
    Progress,
    RunState,
    Stopping,
    SweepError,
    compute_saved,
    fit_progress,
    judge,
    load_sweep,
    projected_hours,
    read_progress,
    rule_verdicts,
)
from megatron_rl.scaling.synthetic import synthetic_curve


def _write(tmp_path: Path, data: dict, name: str = "grid.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------------------------


def test_the_grid_is_the_product_of_the_axes_first_axis_slowest(tmp_path):
    path = _write(
        tmp_path,
        {
            "recipe": "scalerl-cpu",
            "overrides": {"total_steps": 30, "eval": {"every_steps": 5}},
            "axes": {
                "rollout.prompts_per_step": [8, 16],
                "variant": {"base": {}, "no-zvf": {"algo.zero_variance_filter": False}},
            },
        },
    )
    sweep = load_sweep(path)
    assert [r.name for r in sweep.runs] == [
        "prompts_per_step-8_variant-base",
        "prompts_per_step-8_variant-no-zvf",
        "prompts_per_step-16_variant-base",
        "prompts_per_step-16_variant-no-zvf",
    ]
    second = sweep.runs[1]
    assert second.recipe == "scalerl-cpu" and second.model is None
    assert second.overrides == [
        "total_steps=30",
        "eval.every_steps=5",
        "rollout.prompts_per_step=8",
        "algo.zero_variance_filter=false",
    ]
    assert second.labels == {"rollout.prompts_per_step": "8", "variant": "no-zvf"}
    assert all(r.total_steps == 30 for r in sweep.runs)
    assert sweep.name == "grid" and sweep.launcher == "local" and sweep.stopping.rule == "none"


def test_recipe_axis_and_explicit_runs(tmp_path):
    path = _write(
        tmp_path,
        {
            "recipe": "scalerl-cpu",
            "axes": {"recipe": ["scalerl-cpu", "multitask-cpu"]},
            "runs": [{"name": "long", "overrides": ["total_steps=400", "trainer.optimizer.lr=2e-4"]}],
        },
    )
    runs = load_sweep(path).runs
    assert [(r.name, r.recipe) for r in runs] == [
        ("recipe-scalerl-cpu", "scalerl-cpu"),
        ("recipe-multitask-cpu", "multitask-cpu"),
        ("long", "scalerl-cpu"),
    ]
    assert runs[2].overrides == ["total_steps=400", "trainer.optimizer.lr=2e-4"] and runs[2].total_steps == 400
    assert runs[0].total_steps == 200  # scalerl-cpu's own


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"axes": {"rollout.prompts_per_stepp": [8]}}, "axes.rollout.prompts_per_stepp: rollout.prompts_per_stepp: "),
        ({"axes": {"recipe": ["scalerl-cpu", "nosuch"]}}, "axes.recipe: recipe: no such recipe 'nosuch'"),
        (
            {"axes": {"v": {"a": {}, "b": {"algo.zero_variance_filtr": False}}}},
            "axes.v.b: algo.zero_variance_filtr: unknown field",
        ),
        ({"overrides": {"rollout.k": "two"}, "axes": {"total_steps": [5]}}, "overrides.rollout.k: rollout.k: "),
        ({"runs": [{"name": "a", "overrides": {"total_steps": 0}}]}, "runs[0].overrides.total_steps: total_steps: "),
        ({"runs": [{"name": "a", "model": "nosuch"}]}, "runs[0].model: model: no such model 'nosuch'"),
        ({"axes": {"name": ["x"]}}, "axes.name: name is set by the sweep"),
        ({"axes": {"total_steps": 5}}, "axes.total_steps: expected a non-empty list"),
        ({"axes": {"total_steps": [5]}, "stoping": {}}, "stoping: unknown key"),
        ({"axes": {"total_steps": [5]}, "stopping": {"rule": "halve"}}, "stopping.rule: 'halve' is not one of"),
        ({"axes": {"total_steps": [5]}, "stopping": {"confidence": 1.5}}, "stopping.confidence: must be in (0, 1)"),
        ({"axes": {"total_steps": [5]}, "launcher": {"kind": "k8s"}}, "launcher.kind: 'k8s' is not one of"),
        ({"axes": {"total_steps": [5]}, "launcher": {"sbatch_args": "--nodes=2"}}, "launcher.sbatch_args: expected a"),
        ({"runs": [{"name": "a"}, {"name": "a"}]}, "runs: run names must differ; ['a']"),
        ({}, "axes: the sweep has no runs"),
    ],
)
def test_a_bad_sweep_file_is_refused_in_one_line_naming_file_and_field(tmp_path, data, message):
    path = _write(tmp_path, {"recipe": "scalerl-cpu", **data})
    with pytest.raises(SweepError) as info:
        load_sweep(path)
    text = str(info.value)
    assert text.startswith(f"{path}: {message}"), text
    assert "\n" not in text.strip()


# ---------------------------------------------------------------------------------------------------------------
# Metrics as they grow
# ---------------------------------------------------------------------------------------------------------------


def _rows(evals: list[tuple[float, float]], per_eval: int = 1) -> list[dict]:
    rows = []
    for i, (hours, R) in enumerate(evals):
        rows.append({"step": i * per_eval, "device_hours": hours, "val/pass_rate": R})
    return rows


def test_the_reader_keeps_the_last_row_of_a_relogged_step_names_gaps_and_bad_lines_and_waits_for_a_partial_line(
    tmp_path,
):
    path = tmp_path / "metrics.jsonl"
    lines = [
        json.dumps({"run": {"name": "x"}}),
        json.dumps({"step": 0, "device_hours": 0.0, "val/pass_rate": 0.3}),
        json.dumps({"step": 1, "device_hours": 0.1}),
        json.dumps({"step": 2, "device_hours": 0.2, "val/pass_rate": 0.4}),
        "{not json",
        json.dumps({"step": 3, "device_hours": 0.3, "time/step_s": 1.0}),
        json.dumps({"step": 2, "device_hours": 0.21, "val/pass_rate": 0.45}),  # re-logged after a resume
        json.dumps({"step": 5, "device_hours": 0.5, "time/step_s": 1.0}),
        json.dumps({"step": 5, "device_hours": 0.5, "val/pass_rate": 0.5}),  # the final evaluation: not re-logged
    ]
    path.write_text("\n".join(lines) + '\n{"step": 6, "device_')
    p = read_progress(path)
    assert p.last_step == 5 and p.device_hours == 0.5
    assert p.evals == [(0, 0.0, 0.3), (2, 0.21, 0.45), (5, 0.5, 0.5)]
    assert p.relogged == 1 and p.gaps == [(4, 4)]
    assert p.bad_lines == [f"{path}:5: not JSON (Expecting property name enclosed in double quotes)"]
    assert read_progress(tmp_path / "none.jsonl").last_step == 0


# ---------------------------------------------------------------------------------------------------------------
# The stopping rule on synthetic curves
# ---------------------------------------------------------------------------------------------------------------


def _progress(A: float, B: float, C_mid: float, seed: int, points: int = 12, noise: float = 0.005) -> Progress:
    compute, R = synthetic_curve(A, B, C_mid, noise=noise, seed=seed, points=points, max_compute=3 * C_mid)
    evals = [(i, float(c), float(r)) for i, (c, r) in enumerate(zip(compute, R, strict=True))]
    return Progress(last_step=points, device_hours=float(compute[-1]), evals=evals)


SETTINGS = FitSettings(bootstrap=200, min_points=5)


def _fit(name: str, progress: Progress):
    result = fit_progress(name, progress, name, SETTINGS)
    assert not isinstance(result, str), result
    return result


def test_the_rule_stops_a_clearly_lower_curve():
    high, low = _progress(0.80, 1.5, 10.0, seed=1), _progress(0.50, 1.5, 10.0, seed=2)
    fits = {"high": _fit("high", high), "low": _fit("low", low)}
    rule = Stopping("halving", "asymptote", confidence=0.9, margin=0.0, min_evals=5)
    (verdict,) = rule_verdicts(fits, {"high": high, "low": low}, ["high", "low"], rule)
    assert verdict.stop and verdict.run == "low" and verdict.leader == "high"
    # an independent reading of the same draws: the 10th percentile of A_high - A_low, and the fitted A's
    diff = fits["high"].boot.samples[:, 0] - fits["low"].boot.samples[:, 0]
    assert verdict.diff_lo == pytest.approx(np.quantile(diff, 0.1))
    assert verdict.diff_lo > 0.2 and verdict.p_ahead == 1.0
    assert verdict.leader_value == pytest.approx(0.80, abs=0.03) and verdict.run_value == pytest.approx(0.5, abs=0.03)
    # at a compute instead of the asymptote: R there
    # at a compute instead of the asymptote: scaling/decision.py's decide_pair there, with its run-to-run margin
    at = judge(fits["high"], fits["low"], Stopping("halving", 20.0, 0.9, 0.02))
    assert at.stop and at.leader_value == pytest.approx(float(fits["high"].fit.predict([20.0])[0]))
    assert at.describe().startswith("stop low: at 20: high ahead of low by ")
    early = judge(fits["high"], fits["low"], Stopping("halving", 0.01, 0.9, 0.02))  # before either curve rose
    assert not early.stop and "undecided" in early.describe()


def test_the_rule_cannot_fire_when_the_margin_exceeds_any_possible_difference():
    # A fitted asymptote lies in (max(R0, lowest point), 1]: the leader's A minus another run's A is below
    # 1 - R0 of that run in every draw, so a margin of 1 - R0 can never be exceeded.
    high, low = _progress(0.80, 1.5, 10.0, seed=1), _progress(0.50, 1.5, 10.0, seed=2)
    fits = {"high": _fit("high", high), "low": _fit("low", low)}
    margin = 1.0 - fits["low"].fit.R0
    rule = Stopping("halving", "asymptote", confidence=0.9, margin=margin, min_evals=5)
    (verdict,) = rule_verdicts(fits, {"high": high, "low": low}, ["high", "low"], rule)
    assert not verdict.stop and verdict.p_ahead == 0.0


def test_the_rule_does_not_fire_between_the_same_curve_twice():
    # two runs with the same points and the same refits: every paired difference is exactly zero, never > 0
    same = _progress(0.7, 1.5, 10.0, seed=3)
    fits = {"a": _fit("a", same), "b": _fit("b", same)}
    rule = Stopping("halving", "asymptote", confidence=0.5, margin=0.0, min_evals=5)
    verdicts = rule_verdicts(fits, {"a": same, "b": same}, ["a", "b"], rule)
    assert len(verdicts) == 1 and not verdicts[0].stop and verdicts[0].diff_lo == 0.0


def test_the_rule_waits_for_evaluations_and_compute_and_never_judges_the_leader():
    high, low = _progress(0.80, 1.5, 10.0, seed=1), _progress(0.50, 1.5, 10.0, seed=2, points=6)
    fits = {"high": _fit("high", high), "low": _fit("low", low)}
    progress = {"high": high, "low": low}
    assert rule_verdicts(fits, progress, ["high", "low"], Stopping("halving", min_evals=7)) == []
    assert rule_verdicts(fits, progress, ["high", "low"], Stopping("halving", min_evals=6, min_compute=31.0)) == []
    assert [v.run for v in rule_verdicts(fits, progress, ["high", "low"], Stopping("halving", min_evals=6))] == ["low"]
    assert rule_verdicts(fits, progress, ["high", "low"], Stopping("none")) == []


def test_a_run_with_too_few_evaluations_is_not_fitted_and_says_why():
    assert fit_progress("x", _progress(0.7, 1.5, 10.0, 0, points=4), "x", SETTINGS) == "4 of 5 evaluations after R0"


# ---------------------------------------------------------------------------------------------------------------
# Compute saved
# ---------------------------------------------------------------------------------------------------------------


def _state(name: str, status: str, hours: float, step: int, total: int) -> RunState:
    return RunState(name, [], "r", None, total, status=status, last_step=step, device_hours=hours)


def test_compute_saved_by_hand():
    runs = {
        "a": _state("a", "finished", 10.0, 100, 100),  # used 10
        "b": _state("b", "stopped", 3.0, 30, 100),  # 0.1 per step: 10 planned, 7 saved
        "c": _state("c", "stopped", 1.0, 20, 50),  # 0.05 per step: 2.5 planned, 1.5 saved
        "d": _state("d", "crashed", 2.0, 10, 40),  # 0.2 per step: 8 planned, not saved by a stop
    }
    assert [projected_hours(s) for s in runs.values()] == [10.0, 10.0, 2.5, 8.0]
    saved = compute_saved(runs)
    assert saved.used == 4.0 and saved.projected == 12.5 and saved.saved == 8.5
    assert saved.grid == 30.5 and saved.share == pytest.approx(8.5 / 30.5)
    assert compute_saved({"a": runs["a"]}).share == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Launch commands
# ---------------------------------------------------------------------------------------------------------------


def test_the_commands_a_run_is_launched_with(tmp_path):
    path = _write(
        tmp_path,
        {
            "recipe": "scalerl-cpu",
            "axes": {"rollout.prompts_per_step": [8]},
            "launcher": {"kind": "slurm", "sbatch_args": ["--partition=a100"]},
        },
    )
    sweep = load_sweep(path)
    run = sweep.runs[0]
    command = train_command(run, tmp_path / "sw")
    assert command[2:] == [
        "megatron_rl.cli", "train", "--recipe", "scalerl-cpu", "rollout.prompts_per_step=8",
        f"output_dir={tmp_path / 'sw'}", "name=prompts_per_step-8",
    ]  # fmt: skip
    argv, env = sbatch_command(run, sweep, tmp_path / "sw")
    assert argv[:3] == ["sbatch", "--parsable", "--job-name=grid-prompts_per_step-8"]
    assert "--partition=a100" in argv and argv[-1].endswith("slurm/bootstrap.sh")
    assert env == {
        "RECIPE": "scalerl-cpu",
        "MODEL": "",
        "OVERRIDES": "rollout.prompts_per_step=8",
        "RUN_NAME": "prompts_per_step-8",
        "OUTPUT_DIR": str(tmp_path / "sw"),
    }


def test_a_value_with_a_space_cannot_go_through_slurm(tmp_path):
    path = _write(
        tmp_path,
        {"recipe": "scalerl-cpu", "axes": {"data.val_prompts": [8]}, "overrides": {"eval.downstream.benchmarks": []},
         "runs": [{"name": "a", "overrides": {"rollout.tools.enabled": ["python", "calc"]}}],
         "launcher": {"kind": "slurm"}},
    )  # fmt: skip
    with pytest.raises(SweepError, match=r"runs\[0\]\.overrides\.rollout\.tools\.enabled: a value with a space"):
        load_sweep(path)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        (
            "JobId=7 JobName=x\n   JobState=RUNNING Reason=None\n   Requeue=1 Restarts=0\n   ExitCode=0:0\n",
            ("RUNNING", 0, 0),
        ),
        ("JobState=PENDING Reason=BeginTime\n Requeue=1 Restarts=1 BatchFlag=1\n ExitCode=0:0", ("PENDING", 0, 1)),
        ("JobState=FAILED Reason=NonZeroExitCode\n ExitCode=3:0", ("FAILED", 3, 0)),
        ("JobState=CANCELLED Reason=None\n ExitCode=0:15", ("CANCELLED", 143, 0)),
        ("slurm_load_jobs error: Invalid job id specified", (None, None, 0)),
    ],
)
def test_scontrol_job_states(text, parsed):
    assert parse_job(text) == parsed
