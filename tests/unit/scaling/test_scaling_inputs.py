"""Inputs of the scaling toolkit: the metrics JSONL megatron_rl writes, CSV exports, run labels, and the
live prediction the training loop logs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rl.metrics import read_metrics
from megatron_rl.scaling import live_prediction
from megatron_rl.scaling.bootstrap import ar1_filter
from megatron_rl.scaling.curves import label_for, load_curve, load_curves, sort_key
from megatron_rl.scaling.fit import FitError, expit
from megatron_rl.scaling.synthetic import synthetic_curve, table1_curve, write_metrics_jsonl


def _lines(path, *records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_metrics_jsonl_gives_the_validation_curve_in_step_order(tmp_path):
    compute, R = synthetic_curve(0.61, 1.92, 2542, noise=0.005, seed=1)
    path = write_metrics_jsonl(tmp_path / "metrics.jsonl", compute, R, {"name": "scalerl-8b", "model": "llama3_8b"})
    curve = load_curve(path)
    np.testing.assert_allclose(curve.compute, compute)
    np.testing.assert_allclose(curve.R, R)
    assert curve.label == "scalerl-8b" and curve.header["model"] == "llama3_8b"
    assert curve.steps[0] == 0 and not curve.notes
    # The same rows as the package's own reader sees them (the header line skipped).
    rows = read_metrics(path)
    assert [r["val/pass_rate"] for r in rows if "val/pass_rate" in r] == pytest.approx(list(R))


def test_one_curve_per_task_column(tmp_path):
    compute, R = synthetic_curve(0.6, 2.0, 2896, seed=1)
    _, code = synthetic_curve(0.615, 1.09, 1675, seed=2, max_compute=compute.max())
    path = write_metrics_jsonl(tmp_path / "m.jsonl", compute, R, {"name": "mix"}, task_R={"math": R, "code": code})
    curves = load_curves(path, metric="val/pass_rate/*")
    assert [c.label for c in curves] == ["mix math", "mix code"]
    np.testing.assert_allclose(curves[1].R, code)
    assert load_curve(path, metric="val/pass_rate/code").label == "mix"


def test_a_resumed_run_keeps_the_last_row_of_each_step(tmp_path):
    path = _lines(
        tmp_path / "m.jsonl",
        {"run": {"name": "r"}},
        {"step": 0, "device_hours": 0.0, "val/pass_rate": 0.30},
        {"step": 100, "device_hours": 10.0, "val/pass_rate": 0.40},
        {"step": 200, "device_hours": 20.0, "val/pass_rate": 0.99},  # lost: the run died before a checkpoint
        {"step": 200, "device_hours": 21.0, "val/pass_rate": 0.45},  # re-logged after the resume
        {"step": 300, "device_hours": 31.0, "val/pass_rate": 0.50},
    )
    curve = load_curve(path)
    assert list(curve.R) == [0.30, 0.40, 0.45, 0.50]
    assert list(curve.compute) == [0.0, 10.0, 21.0, 31.0]
    assert "1 re-logged steps" in curve.notes[0]


def test_bad_rows_are_named_by_file_line_and_column(tmp_path):
    header = {"run": {"name": "x"}}
    bad = _lines(tmp_path / "a.jsonl", header, {"step": 0, "device_hours": 0, "val/pass_rate": "high"})
    with pytest.raises(FitError, match=r"a.jsonl:2: column 'val/pass_rate' is not a number: 'high'"):
        load_curve(bad)
    (tmp_path / "nan.jsonl").write_text('{"run": {}}\n{"step": 0, "device_hours": NaN, "val/pass_rate": 0.3}\n')
    with pytest.raises(FitError, match=r"nan.jsonl:2: column 'device_hours' is not finite"):
        load_curve(tmp_path / "nan.jsonl")
    no_compute = _lines(tmp_path / "b.jsonl", header, {"step": 0, "device_hours": 0}, {"step": 1, "val/pass_rate": 0.3})
    with pytest.raises(FitError, match=r"b.jsonl:3: column 'device_hours' missing on a row that has 'val/pass_rate'"):
        load_curve(no_compute)
    with pytest.raises(
        FitError, match=r"b.jsonl: column 'val/pass_rate/math' missing; columns are \['val/pass_rate'\]"
    ):
        load_curve(no_compute, metric="val/pass_rate/math")
    backwards = _lines(
        tmp_path / "c.jsonl",
        header,
        {"step": 0, "device_hours": 5.0, "val/pass_rate": 0.3},
        {"step": 100, "device_hours": 1.0, "val/pass_rate": 0.4},
    )
    with pytest.raises(FitError, match=r"c.jsonl:3: 'device_hours' decreases with 'step'"):
        load_curve(backwards)
    (tmp_path / "d.jsonl").write_text('{"run": {}}\n{"step": 0,\n')
    with pytest.raises(FitError, match=r"d.jsonl:2: not JSON"):
        load_curve(tmp_path / "d.jsonl")
    with pytest.raises(FitError, match="no such file"):
        load_curve(tmp_path / "missing.jsonl")


def test_r0_not_at_step_0_is_noted(tmp_path):
    path = _lines(
        tmp_path / "m.jsonl",
        {"run": {"name": "late"}},
        *[{"step": s, "device_hours": s / 10, "val/pass_rate": 0.3 + s / 1e4} for s in range(500, 1200, 100)],
    )
    assert "not 0: R0 is not the initial pass rate" in load_curve(path).notes[0]


def test_csv_export_with_a_column_mapping(tmp_path):
    compute, R = synthetic_curve(0.61, 1.92, 2542, noise=0.005, seed=1)
    rows = [f"{i * 100},{c * 3600},{r}" for i, (c, r) in enumerate(zip(compute, R, strict=True))]
    lines = ["Step,gpu_seconds,eval/accuracy", *rows]
    lines.insert(5, "450,,")  # a wandb row where nothing was evaluated
    path = tmp_path / "export.csv"
    path.write_text("\n".join(lines) + "\n")
    curve = load_curve(path, compute_col="gpu_seconds", metric="eval/accuracy", step_col="Step", compute_scale=1 / 3600)
    np.testing.assert_allclose(curve.compute, compute)
    np.testing.assert_allclose(curve.R, R)
    with pytest.raises(FitError, match=r"column 'device_hours' missing .*\['Step', 'gpu_seconds', 'eval/accuracy'\]"):
        load_curve(path)


def test_run_labels_come_from_the_header_or_the_resolved_config(tmp_path):
    compute, R = synthetic_curve(0.61, 1.92, 2542, seed=1)
    run_dir = tmp_path / "run1"
    path = write_metrics_jsonl(run_dir / "metrics.jsonl", compute, R, {"name": "a", "model": "llama3_8b"})
    (run_dir / "config.yaml").write_text("rollout:\n  generations_per_prompt: 24\n  prompts_per_step: 48\n")
    curve = load_curve(path)
    assert label_for(curve, "model") == "llama3_8b"
    assert label_for(curve, "rollout.generations_per_prompt") == "24"
    with pytest.raises(FitError, match="label key 'rollout.batch' is neither in its header nor in"):
        label_for(curve, "rollout.batch")
    assert sorted(["2048", "512", "8B", "17Bx16", "768"], key=sort_key) == ["512", "768", "2048", "8B", "17Bx16"]


def test_live_prediction_waits_for_points_then_reports_a_with_its_interval():
    compute, R = table1_curve("scalerl-8b", noise=0.005, seed=5)
    rows = []
    for c, r in zip(compute, R, strict=True):
        rows.append({"step": 0, "device_hours": c, "train/loss": 0.1})  # training rows carry no val/pass_rate
        rows.append({"step": 0, "device_hours": c, "val/pass_rate": r})
    early = live_prediction(rows[:10])
    assert early == {} and "4 of 8 points" in early.reason
    out = live_prediction(rows, fit_start=1500, n_boot=50)
    assert out["scaling/A_lo"] < out["scaling/A"] < out["scaling/A_hi"]
    assert abs(out["scaling/A"] - 0.61) < 0.01 and abs(out["scaling/B"] / 1.92 - 1) < 0.1
    assert out["scaling/degenerate"] == 0.0 and out["scaling/points"] > 60
    assert all(isinstance(v, float) for v in out.values())
    # Junk in the rows (None from non-finite logging, strings) is skipped, never raised.
    junk = rows + [{"device_hours": None, "val/pass_rate": 0.5}, {"device_hours": "x", "val/pass_rate": 0.4}]
    assert live_prediction(junk, fit_start=1500, n_boot=20)["scaling/A"] == pytest.approx(out["scaling/A"])
    compute, R = synthetic_curve(0.61, 1.92, 2542, noise=0.01, seed=0, points=20, max_compute=2500)
    rising = [{"device_hours": c, "val/pass_rate": r} for c, r in zip(compute, R, strict=True)]  # no plateau yet
    unsure = live_prediction(rising, n_boot=50)
    assert unsure["scaling/degenerate"] == 1.0 and "not identified" in unsure.reason
    flat = [{"device_hours": float(i), "val/pass_rate": 1.0} for i in range(20)]
    assert live_prediction(flat) == {} and "A_max" in live_prediction(flat).reason


def test_the_numpy_expit_and_ar1_filter_are_scipy_s() -> None:
    from scipy.signal import lfilter
    from scipy.special import expit as scipy_expit

    rng = np.random.default_rng(7)
    z = np.concatenate([rng.normal(0, 30, 100_000), [-1e4, -745.2, 0.0, 745.2, 1e4, np.inf, -np.inf]])
    # numpy's e^x is its own vectorised one on AVX-512 CPUs, the C library's elsewhere (then bitwise scipy's)
    np.testing.assert_array_max_ulp(expit(z), scipy_expit(z), maxulp=4)
    assert np.isnan(expit(np.nan)) and expit(-1e4) == 0.0 and expit(np.inf) == 1.0
    for shape, axis in (((60, 4), 0), ((300, 141), 1), ((9,), 0)):
        for phi in (0.0, 0.37, 0.95, -0.6):
            x = rng.normal(size=shape)
            assert np.array_equal(ar1_filter(x, phi, axis=axis), lfilter([1.0], [1.0, -phi], x, axis=axis))
    x = rng.normal(size=(40, 3))
    assert np.array_equal(ar1_filter(x[::-1], 0.5, axis=0), lfilter([1.0], [1.0, -0.5], x[::-1], axis=0))
