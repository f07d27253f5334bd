"""Bootstrap intervals: behaviour, and calibration against curves with known parameters (100 seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rl.scaling import bootstrap, extrapolation_check, fit_curve, sigmoid
from megatron_rl.scaling.fit import Fit, FitError
from megatron_rl.scaling.synthetic import R0, TABLE1, synthetic_curve, table1_curve

SEEDS = 100


def test_intervals_bracket_the_estimate_and_widen_with_noise_and_level():
    widths = []
    for noise in (0.004, 0.012):
        compute, R = table1_curve("scalerl-8b", noise=noise, seed=1)
        fit = fit_curve(compute, R, fit_start=1500)
        boot = bootstrap(fit, n=300)
        for name, value in (("A", fit.A), ("B", fit.B), ("C_mid", fit.C_mid)):
            lo, hi = boot.interval(name)
            assert lo < value < hi, name
        lo90, hi90 = boot.interval("A")
        lo50, hi50 = boot.interval("A", level=0.5)
        assert lo90 < lo50 < hi50 < hi90
        widths.append(hi90 - lo90)
    assert widths[1] > 2 * widths[0]  # 3x the noise: about 3x the width


def test_prediction_band_contains_the_fit_and_the_observation_interval_is_wider():
    compute, R = table1_curve("gen-32k", noise=0.008, seed=2)
    fit = fit_curve(compute, R, fit_start=1500)
    boot = bootstrap(fit, n=300)
    at = np.array([5000.0, 20000.0, 300000.0])
    lo, hi = boot.predict_interval(at)
    assert (lo < fit.predict(at)).all() and (fit.predict(at) < hi).all()
    olo, ohi = boot.predict_interval(at, observation=True)
    assert ((ohi - olo) > (hi - lo)).all()
    # A new evaluation's interval is at least as wide as the evaluation noise's own 90% range.
    assert ((ohi - olo) > 2 * 1.5 * 0.008).all()


def test_bootstrap_is_reproducible_and_keeps_a_fixed_a():
    compute, R = table1_curve("gens-8", noise=0.008, seed=3)
    fit = fit_curve(compute, R, fit_start=1500)
    a, b = bootstrap(fit, n=50, seed=7), bootstrap(fit, n=50, seed=7)
    np.testing.assert_array_equal(a.samples, b.samples)
    fixed = bootstrap(fit_curve(compute, R, fit_start=1500, A_fixed=0.585), n=50)
    assert (fixed.samples[:, 0] == 0.585).all()
    assert fixed.samples[:, 1].std() > 0


def test_an_interval_reaching_the_bound_of_a_warns():
    # Only the rising half of the curve: the data cannot tell where it levels off.
    compute, R = synthetic_curve(0.61, 1.92, 2542, noise=0.01, seed=0, points=20, max_compute=2500)
    boot = bootstrap(fit_curve(compute, R), n=200)
    assert boot.interval("A")[1] == pytest.approx(1.0, abs=1e-3)
    assert "not identified yet" in boot.warnings()[0]
    compute, R = table1_curve("scalerl-8b", noise=0.01, seed=0)
    assert bootstrap(fit_curve(compute, R, fit_start=1500), n=200).warnings() == []


def test_bootstrap_refuses_what_it_cannot_do():
    compute, R = table1_curve("gens-8", noise=0.008, seed=3)
    fit = fit_curve(compute, R, fit_start=1500)
    with pytest.raises(ValueError, match="parameter 'D'"):
        bootstrap(fit, n=10).interval("D")
    with pytest.raises(ValueError, match="level"):
        bootstrap(fit, n=10).interval("A", level=1.5)
    with pytest.raises(FitError, match="no points"):
        bootstrap(Fit(0.6, 2.0, 100.0, 0.3, 0.0, 10, 0.0, "fast"), n=10)


@pytest.mark.parametrize("run", ["scalerl-8b", "multitask-code"])
def test_90_percent_intervals_cover_the_truth_in_about_90_percent_of_seeds(run):
    # Known parameters, noise 0.01, 100 seeds: the 90% intervals of A, B and C_mid, and the interval of
    # the mean curve at the final compute when fitted on the first half, must cover the truth in 80-98% of
    # them (binomial sd at 90%: 3 points). benchmarks/bench_scaling_fit.py runs every Table 1 row.
    C_mid, B, A = TABLE1[run]
    truth = {"A": A, "B": B, "C_mid": C_mid}
    covered = dict.fromkeys([*truth, "R_final"], 0)
    for seed in range(SEEDS):
        compute, R = table1_curve(run, noise=0.01, seed=1000 + seed)
        fit = fit_curve(compute, R, fit_start=1500)
        boot = bootstrap(fit, n=200, seed=seed)
        for name, value in truth.items():
            lo, hi = boot.interval(name)
            covered[name] += lo <= value <= hi
        check = extrapolation_check(compute, R, compute.max() / 2, fit_start=1500, n_boot=200, seed=seed)
        lo, hi = check.boot.predict_interval([compute.max()])
        covered["R_final"] += lo[0] <= sigmoid([compute.max()], A, B, C_mid, R0)[0] <= hi[0]
    rates = {name: n / SEEDS for name, n in covered.items()}
    assert all(0.80 <= rate <= 0.98 for rate in rates.values()), rates
