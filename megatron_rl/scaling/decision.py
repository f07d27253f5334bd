"""Which configuration wins at a target compute: winner, undecided or crossover, at a stated confidence.

For two or more fitted runs (or groups of repeated runs fitted as one curve) with bootstrap refits:

    d = decide_pair(result_a, result_b, 100_000)        Decision: verdict "winner" / "undecided" / "crossover",
                                                        the leader, R_a - R_b with its interval, C* and its
                                                        interval for a crossover; d.describe(): one line
    decide_pairs(results, [50_000, 100_000])            every pair at every target
    pairs = decide(results, [50_000, 100_000])          the bootstrap alone, each pair at each compute: R_a - R_b,
                                                        its interval, the probability that a is ahead
    cross = crossover(result_a, result_b, (C1, C2))     where the fitted curves last change order, with its
                                                        interval (no test of whether either order is real)

**The difference.** The runs are independent experiments, so their refits are independent draws: the i-th
refit of one curve is paired with the i-th of the other, and R_a(C) - R_b(C) over those pairs is a draw from
the joint bootstrap distribution of the difference (the runs' own refits already resample their runs when a
curve pools repeated runs). The interval is its percentile interval at the fit's level; "P(a ahead)" is the
share of pairs with R_a(C) > R_b(C). Both are of the curves (the expected pass rate at C), not of one new
evaluation, which carries evaluation noise on top (`Bootstrap.predict_interval(..., observation=True)`).

**Run-to-run variation.** The bootstrap of one run resamples its evaluation noise only. Repeated runs of one
recipe differ by more: the paper's three repeated runs gave A within +/-0.015, and it treats A's within 0.02
as the same. On runs whose A varies that much, 90% bootstrap intervals of one run cover its recipe's A about
half the time (benchmarks/README.md, "Coverage of a recipe's A over repeated runs"), and two single runs of
one recipe are called apart far more often than 10% (the calibration below). So `decide_pair` adds to each
draw of R_a - R_b a run-to-run term: a normal shift of sd `run_sd(margin)` = margin / (1.645 sqrt 2) per
single run (two single runs of one recipe then differ by less than `margin` 90% of the time; `margin`
defaults to the paper's 0.02: sd 0.0086 per run), and of sd run_sd / sqrt(k) for a side that pools k
repeated runs (the mean of k runs' deviations). Such a side's refits resample its runs as well, but two or
three runs measure their spread too poorly for the tails of an interval: on pairs of 2- or 3-run groups of
one recipe the bootstrap alone names a winner in 12-16% of the pairs, with the term in 2-4% (the
calibration below; conservative, since the spread is then partly counted twice). The shift is the same at
every compute of a draw (it moves the whole curve), so it also moves C*; it is as large where the curves are
still at R0 as later, which keeps the few thousandths by which fitted curves differ there, where the law's
shape and not the data decides, from counting as an ordering. `margin=0` decides on the bootstrap alone.

**The verdict** at a target compute T, at `confidence` (default 0.9), from these draws on a log grid from
`start` (default: the later of the two runs' first fitted evaluation) to T:
- undecided: the two-sided interval of R_a - R_b at T contains 0; the interval says how far apart the runs
  could be, and whether more compute or repeated runs could tell;
- winner: the interval at T excludes 0; the run ahead there is the leader;
- crossover: as winner, and at some compute in [start, T] the other run is ahead with its own interval
  excluding 0: each order is significant on its side. C* is the last compute before T where the fitted
  curves change order; its interval the percentile interval of the same over the draws, open-ended ("<
  start", "> T") where the percentiles fall outside. An early lead that is not significant is no crossover:
  that is a winner.
A verdict other than undecided on runs of one recipe is an error of the first kind; it occurs at most at
the rate 1 - confidence when the run-to-run term is right (the two tails of the interval at T), since a
crossover also needs the leader significant at T.

**The crossover of the fitted curves** (`crossover`). C* is the last compute in [C1, C2] where the two
fitted curves change order: beyond it the curve that is ahead at C2 stays ahead (sigmoids of different B and
C_mid can cross once, rarely twice). The same is found in every pair of refits, on a log-spaced grid refined
by linear interpolation of the difference in log C; a pair whose order never changes in the range puts C*
below C1 (that curve is ahead throughout) or above C2 (the other curve is still ahead at C2). The interval is
the percentile interval of C* over all pairs, open-ended ("< C1", "> C2") where its percentiles fall outside
the range; with no crossing of the fitted curves themselves the answer is "no crossover within [C1, C2]",
with the share of refits that do cross. It reports the crossing whether or not either order is significant,
so a report of one is `decide_pair`'s.

Calibration on curves with known parameters, AR(1) evaluation noise and run-to-run variation of A
(benchmarks/bench_scaling_decision.py, benchmarks/README.md "Scaling decision"), at 90%, 200 pairs per case:
two runs of one recipe whose A varies by the paper's margin get a winner or a crossover in 39-50% of the pairs
from the bootstrap alone and in 9.6% (1,000 pairs) with the default margin; with evaluation noise only, 6-8%
and 0%. Real differences are found: MoE over 8B (Table 1) in 96% of the pairs, 71% as the crossover at 5,836;
batch 2048 over 512 at 4x the data in 70%; A 0.66 over 0.61 in 96-98%; A differing by 0.03 in 72-74%, by 0.01 in
about 20% (the rest undecided, as the margin says).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations
from typing import Literal

import numpy as np
from scipy.stats import norm

from megatron_rl.scaling.compare import Result
from megatron_rl.scaling.fit import Array, FitError

GRID_POINTS = 512
"""Log-spaced grid points over the crossover range."""
DECISION_GRID_POINTS = 256
"""Log-spaced grid points from the start of the data to the target, where `decide_pair` tests the ordering."""
MARGIN = 0.02
"""Two runs of one recipe differ in expected pass rate by less than this 90% of the time (the paper: three
repeated runs gave A within +/-0.015; it treats A's within 0.02 as the same)."""
MARGIN_COVERAGE = 0.9
"""The share of pairs of runs of one recipe that `margin` bounds."""

Verdict = Literal["winner", "undecided", "crossover"]


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


@dataclass
class Decision:
    """The three-way answer for runs a and b at a target compute (`decide_pair`; module docstring)."""

    a: str
    b: str
    target: float
    verdict: Verdict
    """winner: `leader` ahead at the target; crossover: `leader` ahead at the target and the other ahead
    earlier, both at the confidence; undecided: the data cannot tell at the target."""
    leader: str | None
    """The run ahead at the target (None when undecided)."""
    confidence: float
    margin: float
    """The run-to-run margin the decision was made with (0: the bootstrap alone)."""
    run_sd: float
    """Standard deviation of the run-to-run term added to R_a - R_b: run_sd(margin) sqrt(1/k_a + 1/k_b) for
    sides of k_a and k_b pooled runs (1 for a single run)."""
    diff: float
    """R_a - R_b of the fitted curves at the target."""
    interval: tuple[float, float]
    """Interval of R_a - R_b at the target at `confidence`: the joint bootstrap plus the run-to-run term."""
    p_a_ahead: float
    extrapolated: bool
    """The target lies beyond the last evaluation of either run."""
    start: float
    """Where the ordering was first tested (the later of the two runs' first fitted evaluation)."""
    other_ahead_at: float | None = None
    """Crossover only: the largest compute before C* where the other run is ahead at the confidence."""
    crossover: float | None = None
    """Crossover only: C*, the last compute before the target where the fitted curves change order."""
    crossover_interval: tuple[float, float] | None = None
    """Percentile interval of C* over the draws; -inf: below `start`, +inf: beyond the target."""
    R_a: float = math.nan
    """a's fitted curve at the target."""
    R_b: float = math.nan

    def describe(self) -> str:
        where = f"at {_c(self.target)}" + (" (extrapolated)" if self.extrapolated else "")
        level = f"{self.confidence:.0%}"
        lo, hi = self.interval
        if self.leader is None:
            return (
                f"{where}: {self.a} vs {self.b} undecided: {self.a} - {self.b} = {self.diff:+.3f} "
                f"[{lo:+.3f}, {hi:+.3f}] ({level}) includes 0; a winner needs that interval clear of 0"
            )
        sign = 1.0 if self.leader == self.a else -1.0
        other = self.b if self.leader == self.a else self.a
        lead, (l_lo, l_hi) = sign * self.diff, sorted((sign * lo, sign * hi))
        by = f"by {lead:.3f} [{l_lo:.3f}, {l_hi:.3f}] ({level})"
        if self.verdict == "winner":
            return f"{where}: {self.leader} ahead of {other} {by}"
        assert self.crossover is not None and self.crossover_interval is not None and self.other_ahead_at is not None
        c_lo, c_hi = self.crossover_interval
        lo_text = f"< {_c(self.start)}" if c_lo == -math.inf else _c(c_lo)
        hi_text = f"> {_c(self.target)}" if c_hi == math.inf else _c(c_hi)
        return (
            f"{self.leader} overtakes {other} at {_c(self.crossover)} [{lo_text}, {hi_text}] ({level}): "
            f"{other} ahead at {_c(self.other_ahead_at)}, {self.leader} ahead {where} {by}"
        )

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "a": self.a, "b": self.b, "target": self.target, "verdict": self.verdict, "leader": self.leader,
            "confidence": self.confidence, "margin": self.margin, "run_sd": self.run_sd, "diff": self.diff,
            "lo": self.interval[0], "hi": self.interval[1], "p_a_ahead": self.p_a_ahead,
            "R_a": self.R_a, "R_b": self.R_b, "extrapolated": self.extrapolated, "start": self.start,
            "other_ahead_at": self.other_ahead_at,
            "crossover": self.crossover,
        }  # fmt: skip
        if self.crossover_interval is not None:  # JSON has no infinity: an open end is null
            lo, hi = self.crossover_interval
            out["crossover_lo"] = None if math.isinf(lo) else lo
            out["crossover_hi"] = None if math.isinf(hi) else hi
        out["text"] = self.describe()
        return out


def run_sd(margin: float) -> float:
    """Standard deviation of one run's expected pass rate around its recipe's, such that two runs of one
    recipe differ by less than `margin` with probability `MARGIN_COVERAGE`: margin / (z sqrt(2))."""
    return margin / (float(norm.ppf((1 + MARGIN_COVERAGE) / 2)) * math.sqrt(2))


def _first_fitted(result: Result) -> float:
    points = result.fit.points
    compute = points.compute if points is not None else result.curve.compute[result.curve.compute > 0]
    return float(compute.min())


def decide_pair(
    a: Result,
    b: Result,
    target: float,
    confidence: float = 0.9,
    margin: float = MARGIN,
    start: float | None = None,
) -> Decision:
    """winner / undecided / crossover for runs (or pooled groups of runs) a and b at compute `target`, with
    the ordering tested from `start` (default: where both runs have fitted evaluations) to the target.

    The difference R_a - R_b is drawn from the joint bootstrap (refit i of a against refit i of b) plus a
    run-to-run term of sd `run_sd(margin)` for each side that is a single run, divided by sqrt(k) for a side
    that pools k runs (module docstring). With `margin=0` the decision rests on the bootstrap alone."""
    if not 0 < confidence < 1:
        raise FitError(f"confidence must be in (0, 1), got {confidence}")
    if margin < 0 or not math.isfinite(margin):
        raise FitError(f"margin must be a finite number >= 0, got {margin}")
    if not target > 0:
        raise FitError(f"target compute must be > 0, got {target:g}")
    first = max(_first_fitted(a), _first_fitted(b)) if start is None else start
    if not first > 0:
        raise FitError(f"start compute must be > 0, got {first:g}")
    logc = np.linspace(math.log(first), math.log(target), DECISION_GRID_POINTS) if first < target else None
    c = np.exp(logc) if logc is not None else np.array([target])
    draws_a, draws_b = _draws(a, c), _draws(b, c)
    n = min(draws_a.shape[0], draws_b.shape[0])
    # Each side's curve deviates from its recipe's by the mean of its runs' deviations: sd run_sd / sqrt(k).
    sd = run_sd(margin) * math.sqrt(sum(1 / max(r.boot.runs if r.boot is not None else 1, 1) for r in (a, b)))
    # The run-to-run term shifts a draw's whole difference curve: stratified normal scores (no Monte Carlo
    # noise of their own), in a fixed random order so that they pair with the refits at random.
    scores = norm.ppf((np.arange(n) + 0.5) / n)
    draws = draws_a[:n] - draws_b[:n] + sd * np.random.default_rng(0).permutation(scores)[:, None]
    lo, hi = np.quantile(draws, [(1 - confidence) / 2, (1 + confidence) / 2], axis=0)
    R_a, R_b = a.fit.predict(c), b.fit.predict(c)
    fitted = R_a - R_b
    last = min(float(a.curve.compute.max()), float(b.curve.compute.max()))
    decision = Decision(
        a.curve.label, b.curve.label, target, "undecided", None, confidence, margin, sd,
        float(fitted[-1]), (float(lo[-1]), float(hi[-1])), float(np.mean(draws[:, -1] > 0)), target > last,
        float(c[0]), R_a=float(R_a[-1]), R_b=float(R_b[-1]),
    )  # fmt: skip
    if lo[-1] <= 0 <= hi[-1]:
        return decision
    sign = 1.0 if lo[-1] > 0 else -1.0
    decision.verdict, decision.leader = "winner", (decision.a if sign > 0 else decision.b)
    other_ahead = np.flatnonzero(hi < 0 if sign > 0 else lo > 0)
    if logc is None or other_ahead.size == 0:
        return decision
    # The other run is ahead earlier, at the confidence: C* is where the fitted curves last change order.
    lead = sign * draws
    d_at, d_has = last_crossing(logc, lead)
    placed = np.where(d_has, np.exp(np.where(d_has, d_at, 0.0)), np.where(lead[:, -1] > 0, -math.inf, math.inf))
    c_lo, c_hi = np.quantile(placed, [(1 - confidence) / 2, (1 + confidence) / 2], method="inverted_cdf")
    at, has = last_crossing(logc, sign * fitted[None, :])
    finite = placed[np.isfinite(placed)]
    if not has[0] and finite.size == 0:  # no draw changes order: the early lead is not a crossing
        return decision
    decision.verdict = "crossover"
    decision.other_ahead_at = float(c[other_ahead[-1]])
    decision.crossover = float(math.exp(at[0])) if has[0] else float(np.median(finite))
    decision.crossover_interval = (float(c_lo), float(c_hi))
    return decision


def decide_pairs(
    results: list[Result],
    targets: list[float],
    confidence: float = 0.9,
    margin: float = MARGIN,
    start: float | None = None,
) -> list[Decision]:
    """Every pair of runs at every target."""
    return [decide_pair(a, b, t, confidence, margin, start) for t in targets for a, b in combinations(results, 2)]


def decision_table(decisions: list[Decision], level: float, margin: float) -> str:
    """Plain text: per target, each pair's predictions, difference and P(ahead); then each pair's verdict."""
    lines = []
    for d in decisions:
        where = " (extrapolated)" if d.extrapolated else ""
        ahead = f"P({d.a} ahead) = {d.p_a_ahead:.2f}"
        lines.append(
            f"at {_c(d.target)}{where}: {d.a} {d.R_a:.3f} vs {d.b} {d.R_b:.3f}: difference {d.diff:+.3f} "
            f"[{d.interval[0]:+.3f}, {d.interval[1]:+.3f}], {ahead}"
        )
    lines += [f"decision: {d.describe()}" for d in decisions]
    lines.append(
        f"intervals and P(ahead): {level:.0%} joint bootstrap of the fitted curves (the expected pass rate at that "
        "compute, not one new evaluation, which adds its own noise) plus the run-to-run variation of the runs "
        f"(two runs of one recipe within --margin {margin:g} of each other 90% of the time; a label pooling k runs: "
        "1/sqrt(k) of that); a crossover needs each run ahead at that level on its side"
    )
    return "\n".join(lines)
