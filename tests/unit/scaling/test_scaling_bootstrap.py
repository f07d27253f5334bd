"""Bootstrap intervals: behaviour, and calibration against curves with known parameters (100 seeds), with
independent and autocorrelated (AR(1)) evaluation noise."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_rl.scaling import bootstrap, extrapolation_check, fit_curve, sigmoid
from megatron_rl.scaling.bootstrap import ar1_coefficient, block_length, removed_basis
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
    with pytest.raises(ValueError, match="method must be one of"):
        bootstrap(fit, n=10, method="wild")


def _ar1_series(phi, n, seed):
    rng = np.random.default_rng(seed)
    e = np.empty(n)
    e[0] = rng.normal()
    for t in range(1, n):
        e[t] = phi * e[t - 1] + np.sqrt(1 - phi**2) * rng.normal()
    return e


def test_the_ar1_estimator_recovers_phi_of_a_known_series_and_of_fit_residuals():
    for phi in (0.0, 0.5, 0.8):
        assert ar1_coefficient([_ar1_series(phi, 20_000, seed=1)]) == pytest.approx(phi, abs=0.02)
    # Pooled over short series: the small-sample bias (about -(1 + 3 phi) / n) is corrected.
    short = [_ar1_series(0.8, 40, seed) for seed in range(200)]
    raw = np.mean([np.corrcoef(e[1:], e[:-1])[0, 1] for e in short])
    assert raw < 0.72 and ar1_coefficient(short) == pytest.approx(0.8, abs=0.03)
    # Residuals of a fitted curve: the fit removes the slow part of the noise, the estimate puts it back.
    raws, estimates = [], []
    for seed in range(40):
        compute, R = table1_curve("scalerl-8b", noise=0.01, seed=seed, phi=0.8)
        fit = fit_curve(compute, R, fit_start=1500)
        e = fit.points.R - fit.predict(fit.points.compute)
        raws.append(np.corrcoef(e[1:], e[:-1])[0, 1])
        estimates.append(ar1_coefficient([e], [removed_basis(fit, fit.points.compute)]))
    assert np.mean(raws) < 0.72 and np.mean(estimates) == pytest.approx(0.8, abs=0.04)
    assert block_length(0.0, 71) == 1 and 10 <= block_length(0.8, 71) <= 15 and block_length(0.99, 30) == 10


def test_a_curve_with_as_many_points_as_the_fit_needs_bootstraps_under_every_method():
    # 4 points, 3 parameters and the mean: the residuals leave nothing to estimate an autocorrelation from.
    compute, R = synthetic_curve(0.61, 1.92, 2542, noise=0.01, seed=0, points=4, max_compute=25000)
    fit = fit_curve(compute, R)
    for method in ("ar", "block", "iid"):
        boot = bootstrap(fit, n=50, method=method)
        assert boot.phi == 0.0 and np.isfinite(boot.samples).all()


def test_the_ar_bootstrap_widens_intervals_on_autocorrelated_noise_and_not_on_independent_noise():
    ratios = {0.0: [], 0.8: []}
    for phi in ratios:
        for seed in range(10):
            compute, R = table1_curve("scalerl-8b", noise=0.01, seed=seed, phi=phi)
            fit = fit_curve(compute, R, fit_start=1500)
            ar, iid = bootstrap(fit, n=300, seed=seed), bootstrap(fit, n=300, seed=seed, method="iid")
            assert ar.method == "ar" and iid.method == "iid"
            widths = [np.diff(b.interval("A"))[0] for b in (ar, iid)]
            ratios[phi].append(widths[0] / widths[1])
            if phi == 0.8:
                assert ar.phi > 0.5 and "iid bootstrap intervals are too narrow" in iid.warnings()[-1]
    assert np.median(ratios[0.8]) > 1.8  # AR(0.8): ~9x fewer independent points than evaluations
    assert 0.8 < np.median(ratios[0.0]) < 1.25


def test_repeated_runs_pooled_into_one_curve_carry_their_spread_into_the_intervals():
    # Three runs of one recipe whose asymptotes differ by 0.02 (the paper's run-to-run margin), little noise.
    curves = [
        synthetic_curve(A, 1.9, 2500, noise=0.003, seed=i, max_compute=25000) for i, A in enumerate([0.59, 0.61, 0.63])
    ]
    compute, R = np.concatenate([c for c, _ in curves]), np.concatenate([r for _, r in curves])
    runs = np.repeat([0, 1, 2], curves[0][0].size)
    pooled = fit_curve(compute, R, fit_start=1500, runs=runs)
    assert pooled.points.R.size == 3 * 71  # each run's step-0 point (R0) and warm-up left out
    assert abs(pooled.A - 0.61) < 0.005 and pooled.R0 == R0
    boot = bootstrap(pooled, n=400)
    lo, hi = boot.interval("A")
    assert boot.runs == 3 and lo < 0.60 and hi > 0.62  # the runs' spread, not the noise within a run
    one = bootstrap(fit_curve(curves[0][0], curves[0][1], fit_start=1500), n=400)
    assert hi - lo > 3 * np.diff(one.interval("A"))[0]
    # Each run is cut on its own and needs its own points: a second run stopped at 2,333 has 3 after the cut.
    (c0, r0), (c1, r1) = curves[:2]
    with pytest.raises(FitError, match="run 2 of 2: only 3 points"):
        fit_curve(np.r_[c0, c1[:8]], np.r_[r0, r1[:8]], fit_start=1500, runs=np.r_[np.zeros(c0.size), np.ones(8)])


@pytest.mark.parametrize(("run", "phi"), [("scalerl-8b", 0.0), ("multitask-code", 0.0), ("scalerl-8b", 0.8)])
def test_90_percent_intervals_cover_the_truth_in_about_90_percent_of_seeds(run, phi):
    # Known parameters, noise 0.01 (independent, or AR(1) with phi 0.8), 100 seeds: the 90% intervals of A,
    # B and C_mid, and the interval of the mean curve at the final compute when fitted on the first half,
    # must cover the truth in 80-98% of them (binomial sd at 90%: 3 points). benchmarks/bench_scaling_fit.py
    # runs every Table 1 row, and AR(1) noise of phi 0.5 and 0.8.
    C_mid, B, A = TABLE1[run]
    truth = {"A": A, "B": B, "C_mid": C_mid}
    covered = dict.fromkeys([*truth, "R_final"], 0)
    for seed in range(SEEDS):
        compute, R = table1_curve(run, noise=0.01, seed=1000 + seed, phi=phi)
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
