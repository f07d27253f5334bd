"""Runs side by side (docs/recipe.md §1): fitted parameters per recipe or per scaling-axis label, and the
paper's rule for comparing efficiency.

The paper's rule: repeated runs of one recipe gave A within +/-0.015, so A's within 0.02 are not
distinguishable; such runs are refitted with their mean A and compared on B (higher B: the same gain
for less compute). With more than two runs (ours), runs are sorted by A and split into groups whose A's
span at most the margin; each group of two or more gets its own shared A.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from megatron_rl.scaling.bootstrap import Bootstrap, bootstrap
from megatron_rl.scaling.curves import Curve
from megatron_rl.scaling.extrapolation import Extrapolation, extrapolation_check
from megatron_rl.scaling.fit import Fit, fit_curve, fit_fast


@dataclass
class Result:
    curve: Curve
    fit: Fit
    boot: Bootstrap | None
    extrapolation: Extrapolation | None = None

    def prediction(self, compute: float) -> tuple[float, float | None, float | None]:
        """R at `compute`, with the bootstrap interval of the curve there when there is one."""
        value = float(self.fit.predict([compute])[0])
        if self.boot is None:
            return value, None, None
        lo, hi = self.boot.predict_interval([compute])
        return value, float(lo[0]), float(hi[0])


def fit_run(
    curve: Curve,
    fit_start: float = 0.0,
    method: str = "fast",
    n_boot: int = 1000,
    level: float = 0.9,
    R0: float | None = None,
    extrapolate_from: float | None = None,
    seed: int = 0,
    grid_progress: Callable[[int], None] | None = None,
    bootstrap_method: str = "ar",
) -> Result:
    """Fit one curve (repeated runs pooled when it has several), bootstrap it (n_boot > 0, residuals
    resampled by `bootstrap_method`) and optionally check extrapolation from a compute cut."""
    fit = fit_curve(
        curve.compute, curve.R, R0=R0, fit_start=fit_start, method=method, progress=grid_progress, runs=curve.runs
    )
    fit.warnings = curve.notes + fit.warnings
    boot = bootstrap(fit, n=n_boot, level=level, seed=seed, method=bootstrap_method) if n_boot else None
    if boot is not None:
        fit.warnings += boot.warnings()
    check = None
    if extrapolate_from is not None:
        check = extrapolation_check(
            curve.compute,
            curve.R,
            extrapolate_from,
            fit_start,
            R0,
            max(n_boot, 200),
            level,
            method,
            seed,
            bootstrap_method,
            curve.runs,
        )
    return Result(curve, fit, boot, check)


@dataclass
class SharedA:
    """A group of runs whose A's are within the margin, refitted with their mean A."""

    A: float
    results: list[Result]
    refits: list[Fit]
    boots: list[Bootstrap | None]

    def ranking(self) -> list[tuple[Result, Fit, Bootstrap | None]]:
        """Most compute-efficient (highest B) first."""
        rows = zip(self.results, self.refits, self.boots, strict=True)
        return sorted(rows, key=lambda row: -row[1].B)


def shared_asymptote(
    results: Iterable[Result],
    margin: float = 0.02,
    n_boot: int = 0,
    level: float = 0.9,
    seed: int = 0,
    bootstrap_method: str = "ar",
) -> list[SharedA]:
    """The paper's rule over any number of runs: groups of runs whose A's span <= `margin`, each refitted
    with the group's mean A (B and C_mid free), with bootstrap intervals when n_boot > 0."""
    ordered = sorted(results, key=lambda r: r.fit.A)
    groups: list[list[Result]] = []
    for r in ordered:
        if groups and abs(r.fit.A - groups[-1][0].fit.A) <= margin:
            groups[-1].append(r)
        else:
            groups.append([r])
    shared = []
    for group in groups:
        if len(group) < 2:
            continue
        mean_A = float(np.mean([r.fit.A for r in group]))
        refits = []
        for r in group:
            assert r.fit.points is not None
            refit = fit_fast(r.fit.points, A_fixed=mean_A)
            refit.fit_start = r.fit.fit_start
            refits.append(refit)
        boots = [
            bootstrap(f, n=n_boot, level=level, seed=seed, method=bootstrap_method) if n_boot else None for f in refits
        ]
        shared.append(SharedA(mean_A, group, refits, boots))
    return shared


def _cell(value: float, interval: tuple[float, float] | None, fmt: str) -> str:
    if interval is None:
        return format(value, fmt)
    return f"{value:{fmt}} [{interval[0]:{fmt}}, {interval[1]:{fmt}}]"


def table(results: list[Result], predict_at: list[float] | None = None, axis: str | None = None) -> str:
    """Plain-text table of the fitted parameters per run, with the bootstrap intervals when present."""
    predict_at = predict_at or []
    boots = [r.boot for r in results if r.boot is not None]
    pooled = any(r.curve.n_runs > 1 for r in results)
    head = [axis or "run", "A", "B", "C_mid", "R0", "rmse", "pts"] + ["runs"] * pooled + ["phi"] * bool(boots)
    head += [f"R@{c:g}" for c in predict_at]
    rows = []
    for r in results:
        f, b = r.fit, r.boot
        row = [
            r.curve.label,
            _cell(f.A, b.interval("A") if b else None, ".3f"),
            _cell(f.B, b.interval("B") if b else None, ".2f"),
            _cell(f.C_mid, b.interval("C_mid") if b else None, ",.0f" if f.C_mid >= 100 else ".3g"),
            f"{f.R0:.3f}",
            f"{f.rmse:.4f}",
            str(f.n_points),
        ]
        row += [str(r.curve.n_runs)] * pooled + ([f"{b.phi:.2f}" if b else ""] if boots else [])
        for c in predict_at:
            value, lo, hi = r.prediction(c)
            row.append(_cell(value, None if lo is None else (lo, hi), ".3f"))
        rows.append(row)
    widths = [max(len(str(x)) for x in column) for column in zip(head, *rows, strict=True)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths, strict=True)).rstrip()]
    for r, row in zip(results, rows, strict=True):
        lines.append("  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
        lines += [f"    warning ({r.curve.label}): {w}" for w in r.fit.warnings]
    if boots:
        lines += interval_notes(boots[0], pooled)
        if predict_at:
            lines.append(
                "  R@C: the interval of the fitted curve at C (where the expected pass rate lies); one new evaluation "
                "there varies more (the extrapolation check's interval adds the evaluation noise)."
            )
    return "\n".join(lines)


RESAMPLED = {
    "ar": "residuals resampled as AR(1) series",
    "block": "residuals resampled in moving blocks",
    "iid": "residuals resampled independently (right only if phi is near 0)",
}


def interval_notes(boot: Bootstrap, pooled: bool) -> list[str]:
    """What the intervals of a table cover, printed under it."""
    lines = [
        f"[lo, hi]: {boot.level:.0%} bootstrap intervals, {boot.samples.shape[0]} refits, {RESAMPLED[boot.method]}; "
        "phi: the residuals' lag-1 autocorrelation (AR(1), corrected for the fit)."
    ]
    if pooled:
        lines.append(
            "  Curves of several runs (runs > 1) also resample the runs: their intervals include run-to-run "
            "variation; those of one run cover the noise within that run only."
        )
    else:
        lines.append(
            "  They cover the noise within each run; run-to-run variation (the paper's +/-0.02 on A) needs "
            "repeated runs given one label."
        )
    return lines


def shared_table(groups: list[SharedA], margin: float) -> str:
    if not groups:
        return f"no two runs have A's within {margin}: compare their asymptotes A directly"
    lines = []
    for g in groups:
        names = ", ".join(r.curve.label for r in g.results)
        lines.append(f"A's within {margin} ({names}): refitted with their mean A={g.A:.3f}; by efficiency B:")
        for result, refit, boot in g.ranking():
            B = _cell(refit.B, boot.interval("B") if boot else None, ".2f")
            C = _cell(refit.C_mid, boot.interval("C_mid") if boot else None, ",.0f" if refit.C_mid >= 100 else ".3g")
            lines.append(f"  {result.curve.label:<24} B={B}  C_mid={C}  rmse={refit.rmse:.4f}")
    return "\n".join(lines)


def extrapolation_table(results: list[Result]) -> str:
    lines = []
    for r in results:
        e = r.extrapolation
        if e is None:
            continue
        lines.append(
            f"{r.curve.label}: fit up to {e.cut:g}, predict {e.last_compute:g}: {e.predicted:.3f} "
            f"[{e.interval[0]:.3f}, {e.interval[1]:.3f}] (interval of one new evaluation: curve + evaluation noise) "
            f"vs observed {e.last_observed:.3f} (error {e.error:+.3f}; "
            f"rmse over the {e.heldout_points} held-out points {e.heldout_rmse:.4f})"
        )
    return "\n".join(lines)
