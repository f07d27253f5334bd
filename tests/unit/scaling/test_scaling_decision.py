"""The scaling decision (scaling/decision.py): differences between runs at a compute, the probability that one
is ahead, and where the curves cross, each checked against an independent computation from the same refits; the
three-way verdict (winner / undecided / crossover) on constructed runs whose answer is known."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.signal import lfilter

from megatron_rl.scaling.cli import main as fit_main
from megatron_rl.scaling.compare import fit_run
from megatron_rl.scaling.curves import Curve, pool_runs
from megatron_rl.scaling.decision import (
    crossover,
    decide,
    decide_pair,
    decide_pairs,
    difference,
    last_crossing,
    run_sd,
)
from megatron_rl.scaling.fit import FitError, sigmoid

SMALL = dict(A=0.61, B=2.2, C_mid=6000.0)  # the smaller batch: quick to rise, lower ceiling
LARGE = dict(A=0.70, B=1.5, C_mid=15000.0)  # the larger batch: slower, higher; overtakes near 31.9k


def _curve(label: str, A: float, B: float, C_mid: float, seed: int, c_max: float = 20000.0, sd: float = 0.01):
    rng = np.random.default_rng(seed)
    c = np.concatenate([[1e-9], np.linspace(c_max / 60, c_max, 60)])
    phi = 0.6
    noise = lfilter([1.0], [1.0, -phi], rng.normal(0.0, sd * math.sqrt(1 - phi**2), c.size))
    R = sigmoid(c, A, B, C_mid, 0.3) + noise
    R[0] = 0.3
    return Curve(label, c, R, f"{label}.jsonl")


@pytest.fixture(scope="module")
def results():
    return [fit_run(_curve("768", **SMALL, seed=1), n_boot=400), fit_run(_curve("2048", **LARGE, seed=2), n_boot=400)]


def _R(params: np.ndarray, R0: float, c: float) -> np.ndarray:
    return sigmoid(np.array([c]), params[:, :1], params[:, 1:2], params[:, 2:3], R0)[:, 0]


def test_the_difference_is_the_joint_bootstrap_of_two_independent_fits(results):
    a, b = results
    d = difference(a, b, 100000.0)
    draws = _R(a.boot.samples, a.fit.R0, 1e5) - _R(b.boot.samples, b.fit.R0, 1e5)  # refit i of a with refit i of b
    assert d.diff == pytest.approx(float(a.fit.predict([1e5])[0] - b.fit.predict([1e5])[0]))
    assert d.interval == pytest.approx(tuple(np.quantile(draws, [0.05, 0.95])))
    assert d.p_a_ahead == pytest.approx(float(np.mean(draws > 0)))
    assert d.extrapolated and not difference(a, b, 10000.0).extrapolated
    # where the data are, the smaller batch is ahead with certainty; far out the larger one
    assert difference(a, b, 15000.0).p_a_ahead > 0.99 and d.p_a_ahead < 0.05
    assert len(decide(results, [1e4, 1e5])) == 2


def test_the_crossover_matches_root_finding_on_the_fits_and_on_every_refit(results):
    a, b = results
    cross = crossover(a, b, (5000.0, 1e6))
    gap = lambda fa, fb: lambda lc: float(fa.predict([math.exp(lc)])[0] - fb.predict([math.exp(lc)])[0])  # noqa: E731
    expected = math.exp(brentq(gap(a.fit, b.fit), math.log(5000.0), math.log(1e6)))
    assert cross.compute == pytest.approx(expected, rel=1e-4)
    assert cross.leader == "2048"
    # every refit pair by root finding, those not changing order placed beyond the range's ends
    placed = []
    for pa, pb in zip(a.boot.samples, b.boot.samples, strict=True):
        f = _gap_of(pa, pb, a.fit.R0)
        lo_sign, hi_sign = np.sign(f(math.log(5000.0))), np.sign(f(math.log(1e6)))
        if lo_sign != hi_sign:
            placed.append(math.exp(brentq(f, math.log(5000.0), math.log(1e6))))
        else:
            placed.append(math.inf if hi_sign > 0 else -math.inf)  # the small batch still ahead at C2
    lo, hi = np.quantile(placed, [0.05, 0.95], method="inverted_cdf")
    assert cross.interval[0] == pytest.approx(lo, rel=1e-3) and cross.interval[1] == pytest.approx(hi, rel=1e-3)
    assert cross.share_crossing == pytest.approx(np.mean(np.isfinite(placed)))
    truth = _gap_of(np.array([*SMALL.values()]), np.array([*LARGE.values()]), 0.3)
    true = math.exp(brentq(truth, math.log(5000.0), math.log(1e6)))
    assert cross.interval[0] < true < cross.interval[1]
    assert "2048 overtakes 768 at" in cross.describe()


def _gap_of(pa: np.ndarray, pb: np.ndarray, R0: float):
    """log C -> R_a - R_b for parameter rows (A, B, C_mid)."""
    return lambda lc: float(_R(pa[None], R0, math.exp(lc))[0] - _R(pb[None], R0, math.exp(lc))[0])


def test_no_crossover_within_a_range_says_so(results):
    a, b = results
    cross = crossover(a, b, (5000.0, 15000.0))
    assert cross.compute is None and cross.leader == "768"
    assert cross.describe().startswith("768 vs 2048: no crossover within [5,000, 15,000] (768 ahead")
    with pytest.raises(FitError, match="0 < C1 < C2"):
        crossover(a, b, (2.0, 1.0))


def test_last_crossing_interpolates_in_log_compute():
    logc = np.log(np.array([1.0, 10.0, 100.0]))
    at, has = last_crossing(logc, np.array([[1.0, -1.0, -3.0], [1.0, 2.0, 3.0], [-1.0, 1.0, -1.0]]))
    assert list(has) == [True, False, True]
    assert math.exp(at[0]) == pytest.approx(math.sqrt(10.0))  # halfway between 1 and 10 in log C
    assert math.exp(at[2]) == pytest.approx(math.sqrt(1000.0))  # the last of two changes


def _write(path, name, curve, kind="gpu"):
    rows = [{"run": {"name": name, "device_kind": kind}}]
    rows += [
        {"step": i, "device_hours": float(c), "val/pass_rate": float(r)}
        for i, (c, r) in enumerate(zip(curve.compute, curve.R, strict=True))
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_fit_prints_and_writes_the_decision_and_refuses_mixed_units(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", "768", _curve("768", **SMALL, seed=1))
    b = _write(tmp_path / "b.jsonl", "2048", _curve("2048", **LARGE, seed=2))
    out = tmp_path / "d.json"
    argv = [a, b, "--predict-at", "100000", "--bootstrap", "300", "--json", str(out), "--plot", str(tmp_path / "d.png")]
    assert fit_main(argv) == 0
    text = capsys.readouterr().out
    assert "at 100,000 (extrapolated): 768" in text and "P(768 ahead) =" in text
    assert "2048 overtakes 768 at" in text and "not one new evaluation" in text
    # the crossover is printed as a decision: each run ahead at 90% on its side, the run-to-run term named
    assert "decision: 2048 overtakes 768 at" in text and "768 ahead at" in text and "--margin 0.02" in text
    decision = json.loads(out.read_text())["decision"]
    assert decision["differences"][0]["compute"] == 100000 and decision["crossovers"][0]["leader"] == "2048"
    verdict = decision["verdicts"][0]
    assert verdict["verdict"] == "crossover" and verdict["leader"] == "2048" and verdict["target"] == 100000
    assert verdict["crossover_lo"] < verdict["crossover"] < verdict["crossover_hi"]
    # the printed difference at the target is the verdict's (bootstrap plus the run-to-run term)
    assert f"[{verdict['lo']:+.3f}, {verdict['hi']:+.3f}], P(768 ahead) = {verdict['p_a_ahead']:.2f}" in text
    assert (tmp_path / "d.png").stat().st_size > 0
    c = _write(tmp_path / "c.jsonl", "cpu", _curve("cpu", **SMALL, seed=3), kind="cpu_core")
    assert fit_main([a, c, "--bootstrap", "0"]) == 2
    assert "count compute in different units: 768 (gpu), cpu (cpu_core)" in capsys.readouterr().err


def _run(label: str, A: float, B: float, C_mid: float, seed: int, sd: float = 0.01, n_boot: int = 100, **kw):
    """A fitted, bootstrapped run of 60 evaluations up to 40,000 (AR(1) noise, phi 0.6)."""
    curve = _curve(label, A, B, C_mid, seed, c_max=kw.pop("c_max", 40000.0), sd=sd)
    return fit_run(curve, n_boot=n_boot, seed=kw.pop("boot_seed", seed))


def _root(fa, fb, lo: float, hi: float) -> float:
    gap = lambda lc: float(fa.predict([math.exp(lc)])[0] - fb.predict([math.exp(lc)])[0])  # noqa: E731
    return math.exp(brentq(gap, math.log(lo), math.log(hi)))


def test_run_sd_puts_two_runs_of_one_recipe_within_the_margin_90_percent_of_the_time():
    sd = run_sd(0.02)
    assert sd == pytest.approx(0.02 / (1.6448536269514722 * math.sqrt(2)))
    # |x - y| for two independent N(0, sd^2) runs is |N(0, 2 sd^2)|: P(< 0.02) = erf(0.02 / (2 sd))
    assert math.erf(0.02 / (2 * sd)) == pytest.approx(0.9)
    assert run_sd(0.0) == 0.0


def test_identical_runs_are_undecided_and_their_interval_is_the_margin():
    # The same points and the same bootstrap seed: every refit pair differs by exactly 0, so the interval is the
    # run-to-run term alone, which by construction spans +/- margin at 90% for two single runs.
    curve = _curve("x", **SMALL, seed=5)
    a = fit_run(curve, n_boot=400, seed=3)
    b = fit_run(Curve("y", curve.compute, curve.R, "y.jsonl"), n_boot=400, seed=3)
    d = decide_pair(a, b, 20000.0)
    assert d.verdict == "undecided" and d.leader is None and d.crossover is None
    assert d.diff == 0.0 and d.p_a_ahead == pytest.approx(0.5)
    assert d.interval == pytest.approx((-0.02, 0.02), rel=0.02)
    assert d.margin == 0.02 and d.run_sd == pytest.approx(run_sd(0.02) * math.sqrt(2))
    assert d.describe() == (
        f"at 20,000: x vs y undecided: x - y = +0.000 [{d.interval[0]:+.3f}, {d.interval[1]:+.3f}] (90%) includes 0; "
        "a winner needs that interval clear of 0"
    )
    bare = decide_pair(a, b, 20000.0, margin=0.0)  # the bootstrap alone: no spread at all, still no winner
    assert bare.verdict == "undecided" and bare.interval == (0.0, 0.0) and bare.run_sd == 0.0


@pytest.fixture(scope="module")
def separated():
    """A 0.66 against 0.61 on one shape (B 3, C_mid 8,000): "hi" ahead at every compute; both at R0 early."""
    return _run("hi", 0.66, 3.0, 8000.0, seed=0), _run("lo", 0.61, 3.0, 8000.0, seed=100, boot_seed=1)


def test_clearly_separated_runs_name_the_winner_and_margin_zero_is_the_bootstrap_alone(separated):
    a, b = separated
    for target in (40000.0, 160000.0):
        d = decide_pair(a, b, target)
        assert d.verdict == "winner" and d.leader == "hi" and d.crossover is None and d.other_ahead_at is None
        assert (d.R_a, d.R_b) == pytest.approx((float(a.fit.predict([target])[0]), float(b.fit.predict([target])[0])))
        assert d.diff == pytest.approx(d.R_a - d.R_b)
        assert d.extrapolated == (target > 40000.0)
        bare = decide_pair(a, b, target, margin=0.0)
        alone = difference(a, b, target)  # the joint bootstrap at one compute, computed on its own
        assert bare.interval == pytest.approx(alone.interval, rel=1e-9) and bare.p_a_ahead == alone.p_a_ahead
        # the run-to-run term widens the interval on both sides
        assert d.interval[0] < bare.interval[0] and d.interval[1] > bare.interval[1]
    assert decide_pair(b, a, 40000.0).leader == "hi"
    assert decide_pair(a, b, 40000.0).describe().startswith("at 40,000: hi ahead of lo by 0.053 [")


def test_both_at_R0_early_is_no_crossover(separated):
    # The fitted curves change order among the first evaluations, where neither has left R0 (the old output
    # printed "hi overtakes lo at 6,753"); the true curves never cross. Neither ordering there is significant.
    a, b = separated
    assert crossover(a, b, (40000.0 / 60, 40000.0)).compute is not None
    for margin in (0.0, 0.02):
        d = decide_pair(a, b, 40000.0, margin=margin)
        assert d.verdict == "winner" and d.leader == "hi" and d.crossover is None


def test_a_sharp_crossover_inside_the_data_is_found_with_its_interval():
    # "early" rises to 0.60 around 3,000, "late" to 0.72 around 9,000: the true curves cross at 12,000.
    early = _run("early", 0.60, 3.0, 3000.0, seed=0, sd=0.005)
    late = _run("late", 0.72, 3.0, 9000.0, seed=50, sd=0.005, boot_seed=1)
    truth = _gap_of(np.array([0.60, 3.0, 3000.0]), np.array([0.72, 3.0, 9000.0]), 0.3)
    truth = math.exp(brentq(truth, math.log(2000.0), math.log(40000.0)))
    assert truth == pytest.approx(12000.0, rel=1e-3)
    d = decide_pair(early, late, 40000.0)
    assert d.verdict == "crossover" and d.leader == "late"
    assert d.crossover == pytest.approx(_root(early.fit, late.fit, 2000.0, 40000.0), rel=1e-3)
    lo, hi = d.crossover_interval
    assert lo < d.crossover < hi and lo < truth < hi and hi / lo < 1.5
    assert d.other_ahead_at is not None and d.other_ahead_at < d.crossover  # "early" significantly ahead before C*
    assert d.describe().startswith(f"late overtakes early at {d.crossover:,.0f} [{lo:,.0f}, {hi:,.0f}] (90%): early ")
    # before C* the early run is the winner; one verdict per pair and target
    assert decide_pair(early, late, 8000.0).leader == "early"
    assert [x.verdict for x in decide_pairs([early, late], [8000.0, 40000.0])] == ["winner", "crossover"]


def test_pooled_repeated_runs_add_the_run_to_run_term_of_their_mean():
    def pooled(label: str, seeds: tuple[int, ...], A: float):
        parts = [_curve(label, A, 2.2, 6000.0, seed, c_max=20000.0) for seed in seeds]
        for i, part in enumerate(parts):
            part.source = f"{label}{i}.jsonl"
        return fit_run(pool_runs(parts), n_boot=100)

    a, b, single = pooled("a", (1, 2), 0.61), pooled("b", (3, 4), 0.62), _run("c", 0.61, 2.2, 6000.0, seed=5)
    # a side of k pooled runs deviates from its recipe by the mean of k runs' deviations: sd run_sd / sqrt(k)
    both = decide_pair(a, b, 20000.0)
    assert a.boot.runs == b.boot.runs == 2 and both.margin == 0.02
    assert both.run_sd == pytest.approx(run_sd(0.02) * math.sqrt(1 / 2 + 1 / 2))
    one = decide_pair(a, single, 20000.0)
    assert one.run_sd == pytest.approx(run_sd(0.02) * math.sqrt(1 / 2 + 1))
    assert decide_pair(a, b, 20000.0, margin=0.0).run_sd == 0.0


def test_bad_decision_input_is_refused(separated):
    a, b = separated
    for kwargs, message in (
        ({"confidence": 1.0}, "confidence must be in"),
        ({"margin": -0.01}, "margin must be a finite number >= 0"),
        ({"target": 0.0}, "target compute must be > 0"),
        ({"start": -1.0}, "start compute must be > 0"),
    ):
        with pytest.raises(FitError, match=message):
            decide_pair(a, b, **{"target": 40000.0, **kwargs})
    bare = fit_run(_curve("n", **SMALL, seed=1), n_boot=0)
    with pytest.raises(FitError, match="n: no bootstrap refits"):
        decide_pair(a, bare, 40000.0)


def test_fit_refuses_a_negative_margin(capsys):
    assert fit_main(["a.jsonl", "b.jsonl", "--margin", "-0.01"]) == 2
    assert "--margin must be >= 0, got -0.01" in capsys.readouterr().err
