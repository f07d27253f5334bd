"""Comparing recipes and scaling axes (SCALERL.md §1): fitted parameters side by side, the paper's A-margin rule."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_rl.scaling.curves import Curve
from megatron_rl.scaling.fit import Bootstrap, Fit, bootstrap, fit_curve


@dataclass
class Result:
    curve: Curve
    fit: Fit
    boot: Bootstrap | None


def fit_all(curves: list[Curve], fit_start: float, method: str, n_boot: int, R0: float | None = None) -> list[Result]:
    results = []
    for curve in curves:
        fit = fit_curve(curve.compute, curve.R, R0=R0, fit_start=fit_start, method=method)
        boot = bootstrap(curve.compute, curve.R, fit, n=n_boot) if n_boot else None
        results.append(Result(curve, fit, boot))
    return results


def shared_asymptote(results: list[Result], margin: float = 0.02) -> tuple[float, list[Fit]] | None:
    """The paper's rule: if every A is within `margin` of the others, refit all with their mean A (B compares)."""
    As = [r.fit.A for r in results]
    if len(results) < 2 or max(As) - min(As) > margin:
        return None
    mean_A = float(np.mean(As))
    refits = [
        fit_curve(r.curve.compute, r.curve.R, R0=r.fit.R0, fit_start=r.fit.fit_start, A_fixed=mean_A) for r in results
    ]
    return mean_A, refits


def _cell(boot: Bootstrap | None, name: str, value: float, fmt: str) -> str:
    if boot is None:
        return format(value, fmt)
    lo, hi = boot.interval(name)
    return f"{value:{fmt}} [{lo:{fmt}},{hi:{fmt}}]"


def table(results: list[Result], predict_at: float | None = None) -> str:
    """A plain-text table of the fitted parameters per run (with intervals when bootstrapped)."""
    head = f"{'run':<28}{'A':>22}{'B':>20}{'C_mid':>24}{'R0':>7}{'rmse':>8}{'points':>7}"
    if predict_at:
        head += f"{'R@' + format(predict_at, 'g'):>22}"
    lines = [head]
    for r in results:
        f = r.fit
        line = (
            f"{r.curve.label[:27]:<28}{_cell(r.boot, 'A', f.A, '.3f'):>22}{_cell(r.boot, 'B', f.B, '.2f'):>20}"
            f"{_cell(r.boot, 'C_mid', f.C_mid, '.4g'):>24}{f.R0:>7.3f}{f.rmse:>8.4f}{f.n_points:>7d}"
        )
        if predict_at:
            value = float(f.predict([predict_at])[0])
            if r.boot is not None:
                lo, hi = r.boot.predict_interval([predict_at])
                line += f"{f'{value:.3f} [{lo[0]:.3f},{hi[0]:.3f}]':>22}"
            else:
                line += f"{value:>22.3f}"
        lines.append(line)
        lines += [f"    warning: {w}" for w in f.warnings]
    return "\n".join(lines)
