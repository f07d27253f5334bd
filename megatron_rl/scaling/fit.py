"""Fitting the sigmoidal compute-performance law of SCALERL.md §1, with bootstrap uncertainty.

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

Two procedures:

- `paper`: the paper's grid over A in [0.45, 0.80] (step 0.005) and C_mid over 100 evenly spaced values
  in [100, 40000], scipy `curve_fit` for B at each grid point, least squared error wins. Faithful and
  slow (7,100 small fits), and blind to curves outside its grid.
- `fast` (default, ours): a vectorised coarse grid over (A, log C_mid, log B) with bounds taken from the
  data, then one bounded joint least-squares fit (scipy `least_squares`, trust region) started from the
  best grid point. Same objective, no grid quantisation, ~1,000x faster.

`bootstrap` refits residual-resampled curves (the fitted curve plus residuals drawn with replacement)
from the point estimate and gives percentile intervals for A, B, C_mid and for R at any compute.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.optimize import curve_fit, least_squares

Array = NDArray[np.float64]


class FitError(ValueError):
    """The data cannot be fitted (too few points after the cut, non-finite values, ...)."""


def sigmoid(compute: ArrayLike, A: float, B: float, C_mid: float, R0: float) -> Array:
    c = np.asarray(compute, dtype=np.float64)
    return R0 + (A - R0) / (1.0 + (C_mid / c) ** B)


@dataclass
class Fit:
    A: float
    B: float
    C_mid: float
    R0: float
    rmse: float
    """Root-mean-square residual over the fitted points."""
    n_points: int
    fit_start: float
    method: str
    warnings: list[str] = field(default_factory=list)

    def predict(self, compute: ArrayLike) -> Array:
        return sigmoid(compute, self.A, self.B, self.C_mid, self.R0)

    def efficiency(self, R: ArrayLike) -> Array:
        """F(R) = C_mid^B / ((A - R0)/(R - R0) - 1), which equals C^B on the curve (log-log slope B)."""
        r = np.asarray(R, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.C_mid**self.B / ((self.A - self.R0) / (r - self.R0) - 1.0)

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "A": self.A,
            "B": self.B,
            "C_mid": self.C_mid,
            "R0": self.R0,
            "rmse": self.rmse,
            "n_points": self.n_points,
            "fit_start": self.fit_start,
            "method": self.method,
        }


def prepare(compute: ArrayLike, R: ArrayLike, R0: float | None, fit_start: float) -> tuple[Array, Array, float]:
    """Validated fitting points (compute > max(0, fit_start)) and R0 (given, or the lowest-compute point)."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(R, dtype=np.float64)
    if c.shape != r.shape or c.ndim != 1:
        raise FitError(f"compute and R must be 1-D of equal length, got {c.shape} and {r.shape}")
    bad = ~(np.isfinite(c) & np.isfinite(r))
    if bad.any():
        raise FitError(f"non-finite values at points {np.flatnonzero(bad).tolist()} (compute, R)")
    if R0 is None:
        if c.size == 0:
            raise FitError("no points")
        R0 = float(r[np.argmin(c)])
    keep = (c > max(fit_start, 0.0)) & (c > 0)
    if keep.sum() < 4:
        raise FitError(f"only {int(keep.sum())} points after the warm-up cut (fit_start={fit_start:g}); 4 are needed")
    return c[keep], r[keep], float(R0)


def _degeneracy(A: float, B: float, C_mid: float, A_bounds: tuple[float, float], c: Array) -> list[str]:
    notes = []
    if min(abs(A - A_bounds[0]), abs(A - A_bounds[1])) < 1e-3:
        notes.append(f"A={A:.3f} is at its bound {A_bounds}: the asymptote is not identified by these points")
    if B > 10:
        notes.append(f"B={B:.1f} is huge: the curve is a step; more points around C_mid are needed")
    if C_mid > 100 * c.max():
        notes.append(f"C_mid={C_mid:.3g} is far beyond the data (max compute {c.max():.3g}): extrapolation only")
    return notes


def _a_bounds(r: Array, R0: float) -> tuple[float, float]:
    # A above every observation minus noise, at most 1 (a pass rate) (ours: bounds from the data)
    return max(R0, float(r.min())) + 1e-6, 1.0


def fit_fast(c: Array, r: Array, R0: float, A_fixed: float | None = None, start: Fit | None = None) -> Fit:
    """Coarse vectorised grid, then bounded joint least squares (A, log C_mid, log B)."""
    A_lo, A_hi = _a_bounds(r, R0) if A_fixed is None else (A_fixed, A_fixed)
    logc = np.log(c)
    lc_lo, lc_hi = logc.min() - math.log(100.0), logc.max() + math.log(100.0)
    lb_lo, lb_hi = math.log(0.05), math.log(20.0)

    if start is None:
        As = np.linspace(A_lo, A_hi, 24) if A_fixed is None else np.array([A_fixed])
        lcs = np.linspace(lc_lo, lc_hi, 40)
        lbs = np.linspace(lb_lo, lb_hi, 24)
        a, lcm, lb = np.meshgrid(As, lcs, lbs, indexing="ij")
        pred = R0 + (a[..., None] - R0) / (1.0 + np.exp(np.exp(lb)[..., None] * (lcm[..., None] - logc)))
        sse = ((pred - r) ** 2).sum(-1)
        i = np.unravel_index(np.argmin(sse), sse.shape)
        x0 = [a[i], lcm[i], lb[i]]
    else:
        x0 = [start.A if A_fixed is None else A_fixed, math.log(start.C_mid), math.log(start.B)]

    def residuals(x: Array) -> Array:
        A = x[0] if A_fixed is None else A_fixed
        return R0 + (A - R0) / (1.0 + np.exp(np.exp(x[2]) * (x[1] - logc))) - r

    if A_fixed is None:
        lower, upper = [A_lo, lc_lo, lb_lo], [A_hi, lc_hi, lb_hi]
        x0 = list(np.clip(x0, lower, upper))
        sol = least_squares(residuals, x0, bounds=(lower, upper), method="trf", x_scale=[0.1, 1.0, 0.3])
        A = float(sol.x[0])
    else:
        lower, upper = [lc_lo, lb_lo], [lc_hi, lb_hi]
        x1 = list(np.clip(x0[1:], lower, upper))
        sol = least_squares(lambda x: residuals(np.r_[A_fixed, x]), x1, bounds=(lower, upper), method="trf")
        sol.x = np.r_[A_fixed, sol.x]
        A = A_fixed
    B, C_mid = float(math.exp(sol.x[2])), float(math.exp(sol.x[1]))
    rmse = float(np.sqrt(np.mean(sol.fun**2)))
    return Fit(A, B, C_mid, R0, rmse, int(c.size), 0.0, "fast", _degeneracy(A, B, C_mid, (A_lo, A_hi), c))


def fit_paper(c: Array, r: Array, R0: float, A_grid: Array | None = None, C_mid_grid: Array | None = None) -> Fit:
    """The paper's procedure: grid over A and C_mid, `curve_fit` for B at each grid point."""
    A_grid = np.arange(0.45, 0.80 + 1e-9, 0.005) if A_grid is None else A_grid
    C_mid_grid = np.linspace(100.0, 40000.0, 100) if C_mid_grid is None else C_mid_grid
    best: tuple[float, float, float, float] | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for A in A_grid:
            for C_mid in C_mid_grid:
                try:
                    (B,), _ = curve_fit(
                        lambda x, b, A=A, C_mid=C_mid: sigmoid(x, A, b, C_mid, R0), c, r, p0=[1.5], maxfev=200
                    )
                except RuntimeError:  # curve_fit did not converge at this grid point
                    continue
                sse = float(((sigmoid(c, A, B, C_mid, R0) - r) ** 2).sum())
                if np.isfinite(sse) and (best is None or sse < best[0]):
                    best = (sse, float(A), float(B), float(C_mid))
    if best is None:
        raise FitError("the paper's grid found no converging fit")
    sse, A, B, C_mid = best
    notes = _degeneracy(A, B, C_mid, (float(A_grid.min()), float(A_grid.max())), c)
    if C_mid in (float(C_mid_grid.min()), float(C_mid_grid.max())):
        notes.append(f"C_mid={C_mid:g} is at the edge of the paper's grid [{C_mid_grid.min():g}, {C_mid_grid.max():g}]")
    return Fit(A, B, C_mid, R0, math.sqrt(sse / c.size), int(c.size), 0.0, "paper", notes)


def fit_curve(
    compute: ArrayLike,
    R: ArrayLike,
    R0: float | None = None,
    fit_start: float = 0.0,
    method: str = "fast",
    A_fixed: float | None = None,
) -> Fit:
    """Fit R(C) to the points above `fit_start`; R0 is the lowest-compute point's R unless given."""
    c, r, R0 = prepare(compute, R, R0, fit_start)
    if method == "fast":
        fit = fit_fast(c, r, R0, A_fixed=A_fixed)
    elif method == "paper":
        if A_fixed is not None:
            raise FitError("A_fixed is supported by the fast method only")
        fit = fit_paper(c, r, R0)
    else:
        raise FitError(f"method: {method!r} is not one of ['fast', 'paper']")
    fit.fit_start = fit_start
    return fit


@dataclass
class Bootstrap:
    fit: Fit
    samples: Array
    """[n, 3]: A, B, C_mid of each bootstrap refit."""
    level: float

    def interval(self, name: str) -> tuple[float, float]:
        column = {"A": 0, "B": 1, "C_mid": 2}[name]
        lo, hi = np.quantile(self.samples[:, column], [(1 - self.level) / 2, (1 + self.level) / 2])
        return float(lo), float(hi)

    def predict_interval(self, compute: ArrayLike) -> tuple[Array, Array]:
        """Pointwise interval of R at `compute` (the prediction band of plots)."""
        c = np.atleast_1d(np.asarray(compute, dtype=np.float64))
        curves = sigmoid(c[None, :], self.samples[:, :1], self.samples[:, 1:2], self.samples[:, 2:3], self.fit.R0)
        lo, hi = np.quantile(curves, [(1 - self.level) / 2, (1 + self.level) / 2], axis=0)
        return lo, hi


def bootstrap(
    compute: ArrayLike,
    R: ArrayLike,
    fit: Fit,
    n: int = 1000,
    level: float = 0.9,
    seed: int = 0,
    progress: bool = False,
) -> Bootstrap:
    """Residual bootstrap of `fit` (made by `fit_curve` on the same points): percentile intervals."""
    c, r, _ = prepare(compute, R, fit.R0, fit.fit_start)
    fitted = fit.predict(c)
    residuals = r - fitted
    residuals = residuals - residuals.mean()
    # Inflate residuals for the 3 fitted parameters (Davison & Hinkley's leverage-free correction).
    residuals *= math.sqrt(c.size / max(c.size - 3, 1))
    rng = np.random.default_rng(seed)
    samples = np.empty((n, 3))
    iterator = range(n)
    if progress:
        from tqdm import tqdm

        iterator = tqdm(iterator, desc="bootstrap", leave=False)
    for i in iterator:
        resampled = fitted + rng.choice(residuals, size=c.size, replace=True)
        refit = fit_fast(c, resampled, fit.R0, start=fit)
        samples[i] = (refit.A, refit.B, refit.C_mid)
    return Bootstrap(fit, samples, level)


@dataclass
class Extrapolation:
    cut: float
    fit: Fit
    last_compute: float
    last_observed: float
    predicted: float
    interval: tuple[float, float]

    @property
    def error(self) -> float:
        return self.predicted - self.last_observed


def extrapolation_check(
    compute: ArrayLike, R: ArrayLike, cut: float, fit_start: float = 0.0, R0: float | None = None, n_boot: int = 200
) -> Extrapolation:
    """Fit on the points with compute <= cut, predict the last point (the paper's "fit to 50k, predict 100k")."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(R, dtype=np.float64)
    if R0 is None:
        R0 = float(r[np.argmin(c)])
    head = c <= cut
    fit = fit_curve(c[head], r[head], R0=R0, fit_start=fit_start)
    boot = bootstrap(c[head], r[head], fit, n=n_boot)
    last = int(np.argmax(c))
    lo, hi = boot.predict_interval([c[last]])
    return Extrapolation(
        cut, fit, float(c[last]), float(r[last]), float(fit.predict([c[last]])[0]), (float(lo[0]), float(hi[0]))
    )
