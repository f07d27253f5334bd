"""Validating extrapolation: fit on a run up to a compute cut, predict the rest (docs/recipe.md §1: the paper
fits to 50k GPU-hours and predicts 100k)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from megatron_rl.scaling.bootstrap import Bootstrap, bootstrap
from megatron_rl.scaling.fit import Fit, FitError, fit_curve


@dataclass
class Extrapolation:
    cut: float
    fit: Fit
    """Fitted on the points with compute <= cut."""
    boot: Bootstrap
    last_compute: float
    last_observed: float
    predicted: float
    interval: tuple[float, float]
    """Where a new evaluation at the last compute should fall (curve uncertainty + evaluation noise)."""
    heldout_rmse: float
    """RMS error of the prediction over every point beyond the cut."""
    heldout_points: int

    @property
    def error(self) -> float:
        """Predicted minus observed R at the last point."""
        return self.predicted - self.last_observed

    @property
    def covered(self) -> bool:
        return self.interval[0] <= self.last_observed <= self.interval[1]

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "cut": self.cut,
            "last_compute": self.last_compute,
            "last_observed": self.last_observed,
            "predicted": self.predicted,
            "error": self.error,
            "lo": self.interval[0],
            "hi": self.interval[1],
            "covered": self.covered,
            "heldout_rmse": self.heldout_rmse,
            "heldout_points": self.heldout_points,
        }


def extrapolation_check(
    compute: ArrayLike,
    R: ArrayLike,
    cut: float,
    fit_start: float = 0.0,
    R0: float | None = None,
    n_boot: int = 1000,
    level: float = 0.9,
    method: str = "fast",
    seed: int = 0,
    bootstrap_method: str = "ar",
    runs: ArrayLike | None = None,
) -> Extrapolation:
    """Fit on compute <= `cut` (R0 from the whole run's first point unless given), predict every later
    point; report the error and the interval at the last one. `runs` (a run index per point) pools
    repeated runs as `fit_curve` does."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(R, dtype=np.float64)
    if c.shape != r.shape or c.ndim != 1 or c.size == 0:
        raise FitError(f"compute and R must be 1-D of equal, non-zero length, got shapes {c.shape} and {r.shape}")
    head, tail = c <= cut, c > cut
    if not tail.any():
        raise FitError(f"no points beyond the cut {cut:g} (last compute {c.max():g}): nothing to predict")
    run = None if runs is None else np.asarray(runs)[head]
    # Without R0, the run's first point is R0; fit_curve then leaves it out of the fitted points as usual.
    fit = fit_curve(c[head], r[head], R0=R0, fit_start=fit_start, method=method, runs=run)
    boot = bootstrap(fit, n=n_boot, level=level, seed=seed, method=bootstrap_method)
    last = int(np.argmax(c))
    lo, hi = boot.predict_interval([c[last]], observation=True, seed=seed)
    heldout = fit.predict(c[tail]) - r[tail]
    return Extrapolation(
        cut=cut,
        fit=fit,
        boot=boot,
        last_compute=float(c[last]),
        last_observed=float(r[last]),
        predicted=float(fit.predict([c[last]])[0]),
        interval=(float(lo[0]), float(hi[0])),
        heldout_rmse=float(np.sqrt(np.mean(heldout**2))),
        heldout_points=int(tail.sum()),
    )
