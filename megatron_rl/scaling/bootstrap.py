"""Uncertainty of a fitted curve: residual bootstrap intervals for A, B, C_mid and for R at any compute.

The paper reports point estimates only. Here each bootstrap sample is the fitted curve plus the fit's
residuals drawn with replacement (a residual bootstrap: the evaluation points stay where they are, as
they would in a rerun of the same schedule), refitted by the same least-squares objective; the intervals
are percentiles of the refits (Efron & Tibshirani, "An Introduction to the Bootstrap", ch. 9 and 13).

- Residuals are centred and inflated by sqrt(m / (m - p)) for the p fitted parameters, so their spread
  estimates the noise rather than the (smaller) spread left after fitting (Davison & Hinkley,
  "Bootstrap Methods and their Application", §6.2.3).
- All refits run at once in `levenberg_marquardt`, warm-started at the point estimate: 1,000 refits of a
  75-point curve take well under a second (benchmarks/bench_scaling_fit.py). A refit that does not
  converge is redone from the coarse grid and counted (`regridded`).
- Intervals on R: `predict_interval(C)` is the interval of the mean curve at C (the band of plots);
  `observation=True` adds the evaluation noise (resampled residuals), the interval a new measurement at C
  falls in, which is what an extrapolation check compares against.

Calibration against curves with known parameters: tests/unit/test_scaling_bootstrap.py and the benchmark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from megatron_rl.scaling.fit import Array, Fit, FitError, Points, fit_fast, levenberg_marquardt, search_box, sigmoid

PARAMS = ("A", "B", "C_mid")


@dataclass
class Bootstrap:
    fit: Fit
    samples: Array
    """[n, 3]: A, B, C_mid of each refit."""
    residuals: Array
    """The centred, inflated residual pool the samples were drawn from."""
    level: float
    """Default coverage of the intervals (0.9: the 5th to the 95th percentile)."""
    regridded: int = 0
    """Refits that did not converge from the point estimate and were redone from the coarse grid."""

    def _quantiles(self, values: Array, level: float | None) -> tuple[Array, Array]:
        level = self.level if level is None else level
        if not 0 < level < 1:
            raise ValueError(f"level must be in (0, 1), got {level}")
        lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2], axis=0)
        return lo, hi

    def interval(self, name: str, level: float | None = None) -> tuple[float, float]:
        """Percentile interval of one parameter: "A", "B" or "C_mid"."""
        if name not in PARAMS:
            raise ValueError(f"parameter {name!r} is not one of {list(PARAMS)}")
        lo, hi = self._quantiles(self.samples[:, PARAMS.index(name)], level)
        return float(lo), float(hi)

    def curves(self, compute: ArrayLike) -> Array:
        """R of every bootstrap curve at `compute`: [n_samples, len(compute)]."""
        c = np.atleast_1d(np.asarray(compute, dtype=np.float64))
        A, B, C_mid = self.samples[:, :1], self.samples[:, 1:2], self.samples[:, 2:3]
        return sigmoid(c[None, :], A, B, C_mid, self.fit.R0)

    def predict_interval(
        self, compute: ArrayLike, level: float | None = None, observation: bool = False, seed: int = 0
    ) -> tuple[Array, Array]:
        """Pointwise interval of R at `compute`: of the mean curve (plots' band), or with `observation`
        of a new evaluation there (curve uncertainty plus resampled evaluation noise)."""
        curves = self.curves(compute)
        if observation:
            rng = np.random.default_rng(seed)
            curves = curves + rng.choice(self.residuals, size=curves.shape, replace=True)
        return self._quantiles(curves, level)

    def warnings(self) -> list[str]:
        """Reasons not to trust the intervals: A's interval reaching a bound of its search range means the
        points do not pin the asymptote down yet (more compute, or a lower --fit-start, is needed)."""
        notes = []
        lo, hi = self.interval("A")
        A_lo, A_hi = self.fit.A_bounds
        if A_lo < A_hi and (hi > A_hi - 1e-3 or lo < A_lo + 1e-3):
            notes.append(
                f"A's {self.level:.0%} interval [{lo:.3f}, {hi:.3f}] reaches the bound of [{A_lo:.3f}, {A_hi:.3f}]: "
                "the asymptote is not identified yet"
            )
        return notes

    def as_dict(self, level: float | None = None) -> dict[str, float]:
        out = {}
        for name in PARAMS:
            out[f"{name}_lo"], out[f"{name}_hi"] = self.interval(name, level)
        return out


def bootstrap(fit: Fit, n: int = 1000, level: float = 0.9, seed: int = 0) -> Bootstrap:
    """Residual bootstrap of `fit` (from `fit_curve`, which keeps its points): `n` refits at once."""
    if fit.points is None:
        raise FitError("this fit carries no points to resample; make it with fit_curve")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    points = fit.points
    A_fixed = fit.A if fit.A_bounds[0] == fit.A_bounds[1] else None
    p = 2 if A_fixed is not None else 3
    m = points.R.size
    fitted = fit.predict(points.compute)
    residuals = points.R - fitted
    residuals = (residuals - residuals.mean()) * math.sqrt(m / max(m - p, 1))

    rng = np.random.default_rng(seed)
    resampled = fitted + rng.choice(residuals, size=(n, m), replace=True)
    lower, upper = search_box(points, fit.A_bounds)
    x0 = np.tile([fit.A, math.log(fit.C_mid), math.log(fit.B)], (n, 1))
    free = np.array([A_fixed is None, True, True])
    x, _, converged = levenberg_marquardt(x0, np.log(points.compute), resampled, fit.R0, lower, upper, free)
    samples = np.column_stack([x[:, 0], np.exp(x[:, 2]), np.exp(x[:, 1])])
    redo = np.flatnonzero(~converged)
    for i in redo:
        refit = fit_fast(Points(points.compute, resampled[i], fit.R0), A_fixed=A_fixed, A_max=fit.A_bounds[1])
        samples[i] = (refit.A, refit.B, refit.C_mid)
    return Bootstrap(fit, samples, residuals, level, int(redo.size))
