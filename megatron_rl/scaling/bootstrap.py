"""Uncertainty of a fitted curve: residual bootstrap intervals for A, B, C_mid and for R at any compute.

The paper reports point estimates only. Here each bootstrap sample is the fitted curve plus resampled
residuals (a residual bootstrap: the evaluation points stay where they are, as they would in a rerun of
the same schedule), refitted by the same least-squares objective; the intervals are percentiles of the
refits (Efron & Tibshirani, "An Introduction to the Bootstrap", ch. 9 and 13).

How the residuals are resampled (`method`):

- `ar` (default): the validation points of one run are autocorrelated (the policy wanders slowly around
  its expected curve), so residuals drawn independently understate the noise of a fit: with AR(1) noise
  of phi = 0.8, 90% iid intervals for A cover the truth in about half the curves. The sieve bootstrap
  (Buhlmann 1997, "Sieve bootstrap for time series", Bernoulli 3(2)) fits an autoregression to the
  residuals in compute order, here AR(1) with phi from `ar1_coefficient`, draws its innovations with
  replacement and rebuilds autocorrelated residual series from them. With uncorrelated noise phi is
  near 0 and this is the iid bootstrap.
- `block`: the moving block bootstrap (Kunsch 1989, "The jackknife and the bootstrap for general
  stationary observations", Ann. Statist. 17(3)) glues together runs of consecutive residuals, blocks as
  long as the estimated autocorrelation asks for (`block_length`). It assumes no model for the noise,
  but a 75-point curve holds few long blocks and its intervals run short under strong autocorrelation
  (benchmarks/README.md).
- `iid`: residuals drawn independently with replacement; right only for uncorrelated noise.

Corrections applied under every method:

- Residuals are centred and inflated by sqrt(m / (m - p)) for the p fitted parameters, so their spread
  estimates the noise rather than the (smaller) spread left after fitting (Davison & Hinkley,
  "Bootstrap Methods and their Application", §6.2.3).
- Repeated runs of one recipe fitted as one curve (`Points.runs`): a two-stage bootstrap (Davison &
  Hinkley §3.8). Stage one draws, for each run of the sample, the deviation of one of the runs' own
  fitted curves from the pooled curve (with replacement, inflated by sqrt(k / (k - 1)) for k runs);
  stage two resamples the noise around each run's own curve as above. The intervals then include the
  run-to-run spread; they lean wide, since the runs' own curves carry their noise too. With two or
  three runs the spread between runs is itself poorly known: read such intervals as indicative.

These intervals describe the noise of the curves given; the run-to-run variation of a recipe (the
paper's +/-0.02 on A) is in them only when repeated runs are given.

All refits run at once in `levenberg_marquardt`, warm-started at the point estimate: 1,000 refits of a
75-point curve take well under a second (benchmarks/bench_scaling_fit.py). A refit that does not converge
is redone from the coarse grid and counted (`regridded`).

Intervals on R: `predict_interval(C)` is the interval of the mean curve at C (the band of plots);
`observation=True` adds the evaluation noise (resampled residuals), the interval a new measurement at C
falls in, which is what an extrapolation check compares against.

Calibration against curves with known parameters, iid and autocorrelated noise:
tests/unit/scaling/test_scaling_bootstrap.py and the benchmark.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from megatron_rl.scaling.fit import (
    Array,
    Fit,
    FitError,
    Points,
    _coarse_grid_starts,
    fit_fast,
    levenberg_marquardt,
    search_box,
    sigmoid,
)

PARAMS = ("A", "B", "C_mid")
METHODS = ("ar", "block", "iid")
PHI_BOUNDS = (-0.9, 0.95)
"""The AR(1) coefficient is clipped here: near 1 the rebuilt series would be a random walk."""
AUTOCORRELATION_WARNING = 0.3
"""Above this residual phi, iid intervals are flagged as too narrow."""


def ar1_coefficient(series: Sequence[ArrayLike], bases: Sequence[Array] | None = None) -> float:
    """AR(1) coefficient of the noise behind one or more residual series (each run's, in compute order).

    The lag-1 ratio sum e_t e_(t-1) / sum e_(t-1)^2 of residuals underestimates phi: fitting a curve (and a
    mean) removes the slow part of the noise, which is the autocorrelated part. So phi is the value whose
    expected ratio, under AR(1) noise projected off what the fit removed, equals the observed one (a
    moment-matching bias correction; with the mean alone removed this is the classic small-sample bias
    of the lag-1 autocorrelation, about -(1 + 3 phi) / n, Marriott & Pope 1954). `bases` gives, per series,
    an orthonormal basis [m, q] of what was removed (the fitted curve's Jacobian and the constant: see
    `removed_basis`); default the constant only. Pooled over the series; clipped to `PHI_BOUNDS`; 0 when no
    series has 3 points and 2 more than the basis has columns."""
    arrays = [np.asarray(e, dtype=np.float64) for e in series]
    if bases is None:
        bases = [np.full((e.size, 1), 1 / math.sqrt(max(e.size, 1))) for e in arrays]
    # A series needs points left over after what the fit removed (2 at least) to show an autocorrelation.
    kept = [(e - e.mean(), q) for e, q in zip(arrays, bases, strict=True) if e.size >= max(3, q.shape[1] + 2)]
    den = sum(float(e[:-1] @ e[:-1]) for e, _ in kept)
    if den <= 0:
        return 0.0
    observed = sum(float(e[1:] @ e[:-1]) for e, _ in kept) / den

    def expected(phi: float) -> float:
        moments = [_ar_residual_moments(phi, q) for _, q in kept]
        return sum(sub.sum() for _, sub in moments) / sum(diag[:-1].sum() for diag, _ in moments)

    lo, hi = PHI_BOUNDS
    if expected(lo) >= observed:
        return lo
    if expected(hi) <= observed:
        return hi
    for _ in range(30):  # the expected ratio increases with phi: bisection to 1e-9
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < observed else (lo, mid)
    return (lo + hi) / 2


def removed_basis(fit: Fit, compute: Array) -> Array:
    """Orthonormal basis [m, q] of what fitting `fit` at `compute` (and centring) removes from the noise, to
    first order: the columns of the curve's Jacobian in its free parameters, and the constant."""
    q, r = np.linalg.qr(np.column_stack([fit.jacobian(compute), np.ones(len(compute))]))
    return q[:, np.abs(np.diag(r)) > 1e-10 * np.abs(r).max()]


def _ar_residual_moments(phi: float, basis: Array) -> tuple[Array, Array]:
    """Diagonal and first sub-diagonal of (I - P) S (I - P), the covariance of residuals left by projecting
    AR(1) noise of unit variance (S_ij = phi^|i - j|) off span(basis) (P = basis basis^T). O(m q^2): S
    applied by a forward and a backward AR filter instead of as a matrix."""
    Q = basis
    SQ = ar1_filter(Q, phi, axis=0) + ar1_filter(Q[::-1], phi, axis=0)[::-1] - Q
    G = Q.T @ SQ
    QG = Q @ G
    diag = 1.0 - 2 * (Q * SQ).sum(1) + (QG * Q).sum(1)
    sub = phi - (Q[1:] * SQ[:-1]).sum(1) - (SQ[1:] * Q[:-1]).sum(1) + (QG[1:] * Q[:-1]).sum(1)
    return diag, sub


def ar1_filter(x: Array, phi: float, axis: int) -> Array:
    """y_t = x_t + phi y_(t-1) along `axis`, from y_(-1) = 0: scipy.signal.lfilter([1], [1, -phi], x, axis=axis),
    bitwise (the same products and sums in the same order), by the recursion itself. numpy only: scipy.signal's
    imports (with scipy.optimize and scipy.special, ~70 MiB and ~1.4 s) would stay in the training run's driver
    after its first live fit (live.py)."""
    y = np.array(np.moveaxis(np.asarray(x, dtype=np.float64), axis, 0))
    for t in range(1, y.shape[0]):
        y[t] += phi * y[t - 1]
    return np.moveaxis(y, 0, axis)


def block_length(phi: float, m: int) -> int:
    """Moving-block length for m points of AR(1) noise with coefficient phi: the length that minimises
    the mean squared error of the block bootstrap's variance of a mean, (6 phi^2 / (1 - phi^2)^2)^(1/3)
    m^(1/3) (Politis & White 2004, with the correction of Patton, Politis & White 2009, for an AR(1)
    spectrum), between 1 and m / 3."""
    b = (6 * phi**2 / (1 - phi**2) ** 2) ** (1 / 3) * m ** (1 / 3)
    return int(np.clip(math.ceil(b), 1, max(1, m // 3)))


@dataclass
class Bootstrap:
    fit: Fit
    samples: Array
    """[n, 3]: A, B, C_mid of each refit."""
    residuals: Array
    """The centred, inflated residual pool the samples were drawn from (every run's)."""
    level: float
    """Default coverage of the intervals (0.9: the 5th to the 95th percentile)."""
    regridded: int = 0
    """Refits that did not converge from the point estimate and were redone from the coarse grid."""
    method: str = "ar"
    """How residuals were resampled: `ar`, `block` or `iid` (module docstring)."""
    phi: float = 0.0
    """AR(1) coefficient of the residuals (`ar1_coefficient`), estimated under every method."""
    block: int = 1
    """Block length of the `block` method (1 otherwise)."""
    runs: int = 1
    """Repeated runs the curve pools (1: a single run; intervals then leave out run-to-run variation)."""

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
        points do not pin the asymptote down yet (more compute, or a lower --fit-start, is needed); iid
        resampling of autocorrelated residuals gives intervals that are too narrow."""
        notes = []
        lo, hi = self.interval("A")
        A_lo, A_hi = self.fit.A_bounds
        if A_lo < A_hi and (hi > A_hi - 1e-3 or lo < A_lo + 1e-3):
            notes.append(
                f"A's {self.level:.0%} interval [{lo:.3f}, {hi:.3f}] reaches the bound of [{A_lo:.3f}, {A_hi:.3f}]: "
                "the asymptote is not identified yet"
            )
        if self.method == "iid" and self.phi > AUTOCORRELATION_WARNING:
            notes.append(
                f"the residuals are autocorrelated (AR(1) phi={self.phi:.2f}): iid bootstrap intervals are too "
                "narrow; use the ar method"
            )
        return notes

    def as_dict(self, level: float | None = None) -> dict[str, float]:
        out = {}
        for name in PARAMS:
            out[f"{name}_lo"], out[f"{name}_hi"] = self.interval(name, level)
        return out


def bootstrap(fit: Fit, n: int = 1000, level: float = 0.9, seed: int = 0, method: str = "ar") -> Bootstrap:
    """Residual bootstrap of `fit` (from `fit_curve`, which keeps its points): `n` refits at once, the
    residuals resampled by `method` (`ar`, `block` or `iid`; module docstring)."""
    if fit.points is None:
        raise FitError("this fit carries no points to resample; make it with fit_curve")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    points = fit.points
    A_fixed = fit.A if fit.A_bounds[0] == fit.A_bounds[1] else None
    p = 2 if A_fixed is not None else 3
    rng = np.random.default_rng(seed)
    fitted = fit.predict(points.compute)
    runs = points.run_slices()

    # Stage one, repeated runs only: each sample's run i follows the curve of a run drawn with replacement.
    offsets = np.zeros((n, points.R.size))
    own_fits = [fit] * len(runs)
    if len(runs) > 1:
        k = len(runs)
        own_fits = [fit_fast(Points(points.compute[idx], points.R[idx], fit.R0), A_max=1.0) for idx in runs]
        deviation = np.stack([f.predict(points.compute) for f in own_fits]) - fitted  # [k, m]
        deviation = (deviation - deviation.mean(0)) * math.sqrt(k / (k - 1))
        drawn = rng.integers(k, size=(n, k))
        for i, idx in enumerate(runs):
            offsets[:, idx] = deviation[drawn[:, i][:, None], idx[None, :]]

    # Stage two: the noise around each run's own curve, in compute order.
    series, bases = [], []
    for f, idx in zip(own_fits, runs, strict=True):
        e = points.R[idx] - f.predict(points.compute[idx])
        series.append(e - e.mean())
        bases.append(removed_basis(f, points.compute[idx]))
    phi = ar1_coefficient(series, bases)
    if method == "iid":
        series = [e * math.sqrt(e.size / max(e.size - p, 1)) for e in series]
    else:
        # What the fit removed is partly the noise's slow (autocorrelated) part: scale the residuals back
        # to the spread AR(phi) noise has before a fit (sum(diag) is its expected residual sum of squares
        # per unit variance), the autocorrelated analogue of sqrt(m / (m - p)).
        # Floored at 1 per series as sqrt(m / max(m - p, 1)) is: a curve with as many points as parameters.
        moments = [_ar_residual_moments(phi, q) for q in bases]
        kept = sum(max(float(diag.sum()), 1.0) for diag, _ in moments)
        scale = math.sqrt(sum(e.size for e in series) / kept)
        series = [scale * e for e in series]
    block = block_length(phi, min(e.size for e in series)) if method == "block" else 1
    noise = np.empty((n, points.R.size))
    for idx, e in zip(runs, _resample(series, method, phi, block, n, rng), strict=True):
        noise[:, idx] = e
    resampled = fitted + offsets + noise

    lower, upper = search_box(points, fit.A_bounds)
    x0 = np.tile([fit.A, math.log(fit.C_mid), math.log(fit.B)], (n, 1))
    free = np.array([A_fixed is None, True, True])
    x, _, converged = levenberg_marquardt(x0, np.log(points.compute), resampled, fit.R0, lower, upper, free)
    samples = np.column_stack([x[:, 0], np.exp(x[:, 2]), np.exp(x[:, 1])])
    redo = np.flatnonzero(~converged)
    if redo.size:
        samples[redo] = _refit_from_grid(points, resampled[redo], fit.R0, lower, upper, A_fixed)
    pool = np.concatenate(series)
    return Bootstrap(fit, samples, pool, level, int(redo.size), method, phi, block, len(runs))


def _refit_from_grid(
    points: Points, R: Array, R0: float, lower: Array, upper: Array, A_fixed: float | None, starts: int = 6
) -> Array:
    """A, B, C_mid [n, 3] of curves R [n, m] refitted as `fit_fast` does (Levenberg-Marquardt from the best
    cells of the coarse grid), all curves and starts in one batch."""
    x0 = np.concatenate([_coarse_grid_starts(Points(points.compute, r, R0), lower, upper, A_fixed, starts) for r in R])
    per_curve = x0.shape[0] // R.shape[0]
    free = np.array([A_fixed is None, True, True])
    logc = np.log(points.compute)
    x, sse, _ = levenberg_marquardt(x0, logc, np.repeat(R, per_curve, axis=0), R0, lower, upper, free)
    best = sse.reshape(-1, per_curve).argmin(1)
    x = x.reshape(-1, per_curve, 3)[np.arange(R.shape[0]), best]
    return np.column_stack([x[:, 0], np.exp(x[:, 2]), np.exp(x[:, 1])])


def _resample(
    series: list[Array], method: str, phi: float, block: int, n: int, rng: np.random.Generator
) -> list[Array]:
    """`n` resampled copies [n, len] of each residual series (centred, scaled to the noise's spread)."""
    if method == "iid":
        pool = np.concatenate(series)
        return [rng.choice(pool, size=(n, e.size), replace=True) for e in series]
    if method == "block":
        out = []
        for e in series:
            b = min(block, e.size)
            starts = rng.integers(e.size - b + 1, size=(n, -(-e.size // b)))
            out.append(e[(starts[:, :, None] + np.arange(b)).reshape(n, -1)[:, : e.size]])
        return out
    # Sieve: the innovations u_t = e_t - phi e_(t-1), centred and drawn with replacement, fed through the
    # AR(1) recursion from zero; a burn-in with phi^burn < 1e-3 makes each series start stationary.
    innovations = np.concatenate([e[1:] - phi * e[:-1] for e in series])
    innovations -= innovations.mean()
    burn = math.ceil(math.log(1e-3) / math.log(abs(phi))) if abs(phi) > 1e-3 else 0
    out = []
    for e in series:
        u = rng.choice(innovations, size=(n, burn + e.size), replace=True)
        out.append(ar1_filter(u, phi, axis=1)[:, burn:])
    return out
