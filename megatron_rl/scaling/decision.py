"""Which configuration wins at a target compute, and where the fitted curves cross.

For two or more fitted runs (or groups of repeated runs fitted as one curve) with bootstrap refits:

    pairs = decide(results, [50_000, 100_000])          each pair, at each compute: R_a - R_b, its interval,
                                                        the probability that a is ahead
    cross = crossover(result_a, result_b, (C1, C2))     the compute beyond which the curve ahead at C2 stays
                                                        ahead, with its interval

**The difference.** The runs are independent experiments, so their refits are independent draws: the i-th
refit of one curve is paired with the i-th of the other, and R_a(C) - R_b(C) over those pairs is a draw from
the joint bootstrap distribution of the difference (the runs' own refits already resample their runs when a
curve pools repeated runs). The interval is its percentile interval at the fit's level; "P(a ahead)" is the
share of pairs with R_a(C) > R_b(C). Both are of the curves (the expected pass rate at C), not of one new
evaluation, which carries evaluation noise on top (`Bootstrap.predict_interval(..., observation=True)`).

**The crossover.** C* is the last compute in [C1, C2] where the two fitted curves change order: beyond it the
curve that is ahead at C2 stays ahead (sigmoids of different B and C_mid can cross once, rarely twice). The
same is found in every pair of refits, on a log-spaced grid refined by linear interpolation of the difference
in log C; a pair whose order never changes in the range puts C* below C1 (that curve is ahead throughout) or
above C2 (the other curve is still ahead at C2). The interval is the percentile interval of C* over all pairs,
open-ended ("< C1", "> C2") where its percentiles fall outside the range; with no crossing of the fitted
curves themselves the answer is "no crossover within [C1, C2]", with the share of refits that do cross.

Calibration on curves with known parameters and AR(1) evaluation noise: benchmarks/bench_scaling_decision.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from megatron_rl.scaling.compare import Result
from megatron_rl.scaling.fit import Array, FitError

GRID_POINTS = 512
"""Log-spaced grid points over the crossover range."""


@dataclass
class Difference:
    """R_a - R_b at one compute."""

    a: str
    b: str
    compute: float
    R_a: float
    R_b: float
    diff: float
    interval: tuple[float, float]
    p_a_ahead: float
    """Share of the joint bootstrap draws in which a's curve is above b's."""
    extrapolated: bool
    """The compute lies beyond the last evaluation of either run."""

    def as_dict(self) -> dict[str, object]:
        return {
            "a": self.a,
            "b": self.b,
            "compute": self.compute,
            "R_a": self.R_a,
            "R_b": self.R_b,
            "diff": self.diff,
            "lo": self.interval[0],
            "hi": self.interval[1],
            "p_a_ahead": self.p_a_ahead,
            "extrapolated": self.extrapolated,
        }


@dataclass
class Crossover:
    """Where the curves of a and b last change order within [C1, C2]."""

    a: str
    b: str
    range: tuple[float, float]
    compute: float | None
    """C* of the fitted curves; None when they do not change order within the range."""
    leader: str
    """The curve ahead at C2 (by the fitted curves)."""
    interval: tuple[float, float] | None
    """Percentile interval of C* over the refits; -inf / +inf: beyond the range on that side."""
    share_crossing: float
    """Share of refit pairs that change order within the range."""

    def describe(self) -> str:
        C1, C2 = self.range
        other = self.b if self.leader == self.a else self.a
        share = f"{self.share_crossing:.0%} of refit pairs cross in the range"
        if self.compute is None:
            return f"{self.a} vs {self.b}: no crossover within [{_c(C1)}, {_c(C2)}] ({self.leader} ahead; {share})"
        lo, hi = self.interval if self.interval is not None else (math.nan, math.nan)
        lo_text = f"< {_c(C1)}" if lo == -math.inf else _c(lo)
        hi_text = f"> {_c(C2)}" if hi == math.inf else _c(hi)
        return f"{self.leader} overtakes {other} at {_c(self.compute)} [{lo_text}, {hi_text}] ({share})"

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"a": self.a, "b": self.b, "range": list(self.range), "compute": self.compute}
        out["leader"] = self.leader
        out["share_crossing"] = self.share_crossing
        if self.interval is not None:  # JSON has no infinity: an open end is null
            out["lo"] = None if math.isinf(self.interval[0]) else self.interval[0]
            out["hi"] = None if math.isinf(self.interval[1]) else self.interval[1]
        return out


def _c(compute: float) -> str:
    """Compute for text: 42,310 / 0.057."""
    return f"{compute:,.0f}" if abs(compute) >= 100 else f"{compute:.3g}"


def _level(result: Result, level: float | None) -> float:
    return level if level is not None else (result.boot.level if result.boot is not None else 0.9)


def _draws(result: Result, compute: Array) -> Array:
    if result.boot is None:
        raise FitError(f"{result.curve.label}: no bootstrap refits (--bootstrap 0); a decision needs them")
    return result.boot.curves(compute)


def difference(a: Result, b: Result, compute: float, level: float | None = None) -> Difference:
    """R_a - R_b at `compute` with its joint-bootstrap interval and P(a ahead) (module docstring)."""
    at = np.array([compute])
    draws_a, draws_b = _draws(a, at)[:, 0], _draws(b, at)[:, 0]
    n = min(draws_a.size, draws_b.size)
    draws = draws_a[:n] - draws_b[:n]
    level = _level(a, level)
    lo, hi = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    R_a, R_b = float(a.fit.predict([compute])[0]), float(b.fit.predict([compute])[0])
    last = min(float(a.curve.compute.max()), float(b.curve.compute.max()))
    return Difference(
        a.curve.label, b.curve.label, compute, R_a, R_b, R_a - R_b, (float(lo), float(hi)),
        float(np.mean(draws > 0)), compute > last,
    )  # fmt: skip


def decide(results: list[Result], computes: list[float], level: float | None = None) -> list[Difference]:
    """Every pair of runs at every compute."""
    return [difference(a, b, c, level) for c in computes for a, b in combinations(results, 2)]


def last_crossing(logc: Array, diff: Array) -> tuple[Array, Array]:
    """Per row of `diff` [n, g] over the grid `logc` [g]: log C of the last sign change (linear interpolation
    between the grid points around it) and whether there is one."""
    sign = np.sign(diff)
    change = (sign[:, 1:] * sign[:, :-1]) < 0
    has = change.any(axis=1)
    last = change.shape[1] - 1 - np.argmax(change[:, ::-1], axis=1)  # index i: the change is between i and i+1
    rows = np.arange(diff.shape[0])
    d0, d1 = diff[rows, last], diff[rows, last + 1]
    frac = d0 / np.where(d0 - d1 == 0, 1.0, d0 - d1)
    at = logc[last] + frac * (logc[last + 1] - logc[last])
    return at, has


def crossover(a: Result, b: Result, compute_range: tuple[float, float], level: float | None = None) -> Crossover:
    """Where the fitted curves of a and b last change order within `compute_range`, with its interval."""
    C1, C2 = compute_range
    if not 0 < C1 < C2:
        raise FitError(f"crossover range must be 0 < C1 < C2, got [{C1:g}, {C2:g}]")
    level = _level(a, level)
    logc = np.linspace(math.log(C1), math.log(C2), GRID_POINTS)
    c = np.exp(logc)
    fitted = (a.fit.predict(c) - b.fit.predict(c))[None, :]
    at, has = last_crossing(logc, fitted)
    a_leads = fitted[0, -1] > 0
    leader = a.curve.label if a_leads else b.curve.label
    draws_a, draws_b = _draws(a, c), _draws(b, c)
    n = min(draws_a.shape[0], draws_b.shape[0])
    draws = draws_a[:n] - draws_b[:n]
    if not a_leads:
        draws = -draws  # positive: the fitted leader ahead
    d_at, d_has = last_crossing(logc, draws)
    # Without a change of order in the range: the leader ahead throughout (C* < C1), or still behind at C2.
    placed = np.where(d_has, np.exp(np.where(d_has, d_at, 0.0)), np.where(draws[:, -1] > 0, -math.inf, math.inf))
    lo, hi = np.quantile(placed, [(1 - level) / 2, (1 + level) / 2], method="inverted_cdf")
    return Crossover(
        a.curve.label,
        b.curve.label,
        (C1, C2),
        float(math.exp(at[0])) if has[0] else None,
        leader,
        (float(lo), float(hi)) if has[0] else None,
        float(np.mean(d_has)),
    )


def crossovers(results: list[Result], compute_range: tuple[float, float]) -> list[Crossover]:
    return [crossover(a, b, compute_range) for a, b in combinations(results, 2)]


def decision_table(differences: list[Difference], crosses: list[Crossover], level: float) -> str:
    """Plain text: per compute, each pair's difference and P(ahead); then the crossovers."""
    lines = []
    for d in differences:
        where = " (extrapolated)" if d.extrapolated else ""
        ahead = f"P({d.a} ahead) = {d.p_a_ahead:.2f}"
        lines.append(
            f"at {_c(d.compute)}{where}: {d.a} {d.R_a:.3f} vs {d.b} {d.R_b:.3f}: difference {d.diff:+.3f} "
            f"[{d.interval[0]:+.3f}, {d.interval[1]:+.3f}], {ahead}"
        )
    lines += [c.describe() for c in crosses]
    lines.append(
        f"intervals: {level:.0%} joint bootstrap of the fitted curves (the expected pass rate at that compute, not "
        "one new evaluation, which adds its own noise)"
    )
    return "\n".join(lines)
