"""The scaling-curve toolkit against curves with known parameters (the paper's Table 1)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rl.scaling import extrapolation_check, fit_curve, live_prediction
from megatron_rl.scaling.cli import main as fit_main
from megatron_rl.scaling.curves import load_curve
from megatron_rl.scaling.fit import FitError, bootstrap, sigmoid
from megatron_rl.scaling.synthetic import R0, TABLE1, synthetic_curve


def test_sigmoid_hits_r0_half_gain_at_c_mid_and_the_asymptote():
    assert sigmoid([1e-12], 0.6, 2.0, 100.0, 0.3)[0] == pytest.approx(0.3)
    assert sigmoid([100.0], 0.6, 2.0, 100.0, 0.3)[0] == pytest.approx(0.45)
    assert sigmoid([1e9], 0.6, 2.0, 100.0, 0.3)[0] == pytest.approx(0.6, abs=1e-9)


@pytest.mark.parametrize("run", sorted(TABLE1))
@pytest.mark.parametrize("noise", [0.005, 0.01])
def test_fit_recovers_table1_parameters_and_extrapolates(run, noise):
    C_mid, B, A = TABLE1[run]
    compute, R = synthetic_curve(A, B, C_mid, noise=noise, seed=7)
    fit_start = min(1500.0, C_mid / 2)
    fit = fit_curve(compute, R, fit_start=fit_start)
    assert fit.R0 == R0  # taken from the step-0 point, not fitted
    assert abs(fit.A - A) < 0.01
    assert abs(fit.B / B - 1) < 0.10
    assert abs(fit.C_mid / C_mid - 1) < 0.15
    check = extrapolation_check(compute, R, cut=compute.max() / 2, fit_start=fit_start, n_boot=20)
    assert abs(check.predicted - sigmoid([compute.max()], A, B, C_mid, R0)[0]) < 0.02


def test_fast_and_paper_procedures_agree_on_the_paper_grid():
    compute, R = synthetic_curve(0.61, 1.92, 2542, noise=0.005, seed=3)
    fast = fit_curve(compute, R, fit_start=1500)
    paper = fit_curve(compute, R, fit_start=1500, method="paper")
    assert abs(fast.A - paper.A) < 0.005 and abs(fast.B / paper.B - 1) < 0.05
    assert fast.rmse <= paper.rmse + 1e-9  # no grid quantisation: never worse on the same objective


def test_bootstrap_interval_is_calibrated():
    # 40 seeds here (the benchmark runs 100): the 90% interval of A must cover the truth in most of them.
    C_mid, B, A = TABLE1["scalerl-8b"]
    covered = 0
    for seed in range(40):
        compute, R = synthetic_curve(A, B, C_mid, noise=0.01, seed=100 + seed)
        fit = fit_curve(compute, R, fit_start=1500)
        lo, hi = bootstrap(compute, R, fit, n=150, seed=seed).interval("A")
        covered += lo <= A <= hi
    assert 0.75 <= covered / 40 <= 1.0


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FitError, match="non-finite values at points \\[2\\]"):
        fit_curve([0, 1, 2, 3, 4, 5], [0.1, 0.2, float("nan"), 0.3, 0.4, 0.4])
    with pytest.raises(FitError, match="only 2 points after the warm-up cut"):
        fit_curve([0, 1, 2, 3, 4, 5], [0.1, 0.2, 0.3, 0.3, 0.4, 0.4], fit_start=3)
    csv = tmp_path / "export.csv"
    csv.write_text("Step,gpu_hours\n1,2\n")
    with pytest.raises(FitError, match="column 'val/pass_rate' missing; columns are \\['Step', 'gpu_hours'\\]"):
        load_curve(csv, compute_col="gpu_hours")
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"run": {"name": "x"}}\n{"step": 0, "device_hours": 0, "val/pass_rate": "high"}\n')
    with pytest.raises(FitError, match="m.jsonl:2: column 'val/pass_rate' is not a number"):
        load_curve(bad)


def test_degenerate_fit_warns():
    compute = np.linspace(0, 100, 40)
    R = 0.2 + 0.002 * compute  # a straight line: no asymptote in sight
    fit = fit_curve(compute, R)
    assert fit.warnings


def _write_run(path, name, A, B, C_mid, seed):
    compute, R = synthetic_curve(A, B, C_mid, noise=0.005, seed=seed)
    lines = [json.dumps({"run": {"name": name}})]
    for i, (c, r) in enumerate(zip(compute, R, strict=True)):
        lines.append(json.dumps({"step": i * 10, "device_hours": c, "train/loss": 0.1}))
        lines.append(json.dumps({"step": i * 10, "device_hours": c, "val/pass_rate": r}))
    path.write_text("\n".join(lines) + "\n")


def test_cli_fits_compares_and_plots(tmp_path, capsys):
    _write_run(tmp_path / "a.jsonl", "recipe-a", 0.61, 1.92, 2542, 1)
    _write_run(tmp_path / "b.jsonl", "recipe-b", 0.62, 1.5, 2542, 2)
    out = tmp_path / "plot.png"
    code = fit_main(
        [
            str(tmp_path / "a.jsonl"),
            str(tmp_path / "b.jsonl"),
            "--fit-start",
            "1500",
            "--predict-at",
            "100000",
            "--plot",
            str(out),
            "--compare",
            "--bootstrap",
            "30",
            "--json",
            str(tmp_path / "fit.json"),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "recipe-a" in text and "R@100000" in text and "shared A" in text
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    fitted = json.loads((tmp_path / "fit.json").read_text())
    assert abs(fitted["recipe-a"]["A"] - 0.61) < 0.01


def test_live_prediction_waits_for_points_then_reports_an_interval():
    compute, R = synthetic_curve(0.61, 1.92, 2542, noise=0.005, seed=5)
    rows = [{"device_hours": c, "val/pass_rate": r} for c, r in zip(compute, R, strict=True)]
    assert live_prediction(rows[:4]) == {}
    out = live_prediction(rows, fit_start=1500, n_boot=30)
    assert out["scaling/A_lo"] <= out["scaling/A"] <= out["scaling/A_hi"]
    assert abs(out["scaling/A"] - 0.61) < 0.01
