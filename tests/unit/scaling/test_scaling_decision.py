"""The scaling decision (scaling/decision.py): differences between runs at a compute, the probability that one
is ahead, and where the curves cross, each checked against an independent computation from the same refits."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.signal import lfilter

from megatron_rl.scaling.cli import main as fit_main
from megatron_rl.scaling.compare import fit_run
from megatron_rl.scaling.curves import Curve
from megatron_rl.scaling.decision import crossover, decide, difference, last_crossing
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
    decision = json.loads(out.read_text())["decision"]
    assert decision["differences"][0]["compute"] == 100000 and decision["crossovers"][0]["leader"] == "2048"
    assert (tmp_path / "d.png").stat().st_size > 0
    c = _write(tmp_path / "c.jsonl", "cpu", _curve("cpu", **SMALL, seed=3), kind="cpu_core")
    assert fit_main([a, c, "--bootstrap", "0"]) == 2
    assert "count compute in different units: 768 (gpu), cpu (cpu_core)" in capsys.readouterr().err
