"""Live prediction for the training loop: the asymptote A with its interval from the validation points so far."""

from __future__ import annotations

from typing import Any

from megatron_rl.scaling.fit import FitError, bootstrap, fit_curve


def live_prediction(
    rows: list[dict[str, Any]],
    fit_start: float = 0.0,
    metric: str = "val/pass_rate",
    compute_col: str = "device_hours",
    n_boot: int = 100,
    min_points: int = 6,
) -> dict[str, float]:
    """`scaling/*` metrics (A, its 90% interval, B, C_mid) or {} while there are too few points.

    Cheap enough for every evaluation: one fast fit and `n_boot` warm-started refits (~0.1 s)."""
    points = [(float(r[compute_col]), float(r[metric])) for r in rows if r.get(metric) is not None and compute_col in r]
    if len([c for c, _ in points if c > fit_start]) < min_points:
        return {}
    points.sort()
    compute, R = [c for c, _ in points], [v for _, v in points]
    try:
        fit = fit_curve(compute, R, fit_start=fit_start)
        lo, hi = bootstrap(compute, R, fit, n=n_boot).interval("A")
    except FitError:
        return {}
    return {"scaling/A": fit.A, "scaling/A_lo": lo, "scaling/A_hi": hi, "scaling/B": fit.B, "scaling/C_mid": fit.C_mid}
