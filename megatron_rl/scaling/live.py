"""Live prediction for the training loop: the asymptote A with its interval from the validation points so far."""

from __future__ import annotations

import math
from typing import Any

from megatron_rl.scaling.bootstrap import bootstrap
from megatron_rl.scaling.fit import FitError, fit_curve


class LivePrediction(dict[str, float]):
    """`scaling/*` metrics to log; empty, with `reason` saying why, while no prediction can be made."""

    def __init__(self, metrics: dict[str, float] | None = None, reason: str = "") -> None:
        super().__init__(metrics or {})
        self.reason = reason


def live_prediction(
    rows: list[dict[str, Any]],
    fit_start: float = 0.0,
    metric: str = "val/pass_rate",
    compute_col: str = "device_hours",
    n_boot: int = 100,
    level: float = 0.9,
    min_points: int = 8,
    bootstrap_method: str = "ar",
) -> LivePrediction:
    """Fit the validation points in `rows` (metrics rows, as `megatron_rl.metrics.read_metrics` returns
    them; rows without `metric` are skipped) and return `scaling/A`, `scaling/A_lo`, `scaling/A_hi`
    (the `level` interval; residuals resampled by `bootstrap_method`, autocorrelation-aware by default:
    scaling/bootstrap.py), `scaling/B`, `scaling/C_mid`, `scaling/R0`, `scaling/rmse`, `scaling/points`,
    `scaling/phi` (the residuals' AR(1) coefficient) and `scaling/degenerate` (1.0 when the fit or its
    interval warned; `reason` says why). The interval covers the noise within this run, not run-to-run
    variation.

    Cheap enough for every evaluation: one fast fit and `n_boot` refits in one batch (a few ms). Never
    raises on data: while there are fewer than `min_points` points after `fit_start`, or the fit fails,
    it returns an empty LivePrediction whose `reason` says why."""
    points = []
    for row in rows:
        value, compute = row.get(metric), row.get(compute_col)
        numbers = isinstance(value, (int, float)) and isinstance(compute, (int, float))
        if numbers and math.isfinite(value) and math.isfinite(compute):
            points.append((float(compute), float(value)))
    points.sort()
    usable = sum(c > fit_start for c, _ in points[1:])  # the first point is R0
    if usable < min_points:
        return LivePrediction(reason=f"{usable} of {min_points} points after fit_start={fit_start:g}")
    compute, R = [c for c, _ in points], [v for _, v in points]
    try:
        fit = fit_curve(compute, R, fit_start=fit_start)
    except FitError as exc:
        return LivePrediction(reason=str(exc))
    boot = bootstrap(fit, n=n_boot, level=level, method=bootstrap_method)
    lo, hi = boot.interval("A")
    notes = fit.warnings + boot.warnings()
    metrics = {
        "scaling/A": fit.A,
        "scaling/A_lo": lo,
        "scaling/A_hi": hi,
        "scaling/B": fit.B,
        "scaling/C_mid": fit.C_mid,
        "scaling/R0": fit.R0,
        "scaling/rmse": fit.rmse,
        "scaling/points": float(fit.n_points),
        "scaling/phi": boot.phi,
        "scaling/degenerate": float(bool(notes)),
    }
    return LivePrediction(metrics, reason="; ".join(notes))
