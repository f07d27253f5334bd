"""Fitting the sigmoidal compute-performance law of docs/recipe.md §1.

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

R0 is measured (the first validation point, before any training) and not fitted. Points at or below the
warm-up cut `fit_start` (paper: 1.5k GPU-hours) are dropped. Two procedures minimise the same squared
error over the remaining points:

- `paper`: the paper's grid, A in [0.45, 0.80] step 0.005 and C_mid at 100 evenly spaced values in
  [100, 40000], with scipy `curve_fit` for B at each of the 7,100 grid points; the least squared error
  wins. Faithful, slow, quantised to the grid and blind to curves outside it.
- `fast` (default, ours): a vectorised coarse grid over (A, log C_mid, log B) whose bounds come from the
  data, then Levenberg-Marquardt from the best few grid points at once (`levenberg_marquardt`, batched
  over starting points and, in bootstrap.py, over resampled curves). No grid quantisation; ~100x faster.

C_mid and B are fitted as logarithms: both are positive and scale-like, and the squared error is much
closer to quadratic in log C_mid than in C_mid.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike, NDArray

Array = NDArray[np.float64]

METHODS = ("fast", "paper")
PAPER_A_GRID = np.round(np.arange(0.45, 0.80 + 1e-9, 0.005), 3)
PAPER_C_MID_GRID = np.linspace(100.0, 40000.0, 100)
MIN_POINTS = 4
"""Fewest points after the cut that a fit accepts (3 parameters + 1)."""
B_BOUNDS = (0.05, 20.0)
C_MID_MARGIN = 100.0
"""C_mid may lie this factor below the first or above the last fitted compute (beyond: degenerate)."""


class FitError(ValueError):
    """The data cannot be fitted: too few points after the cut, non-finite values, a missing column..."""


def expit(z: ArrayLike) -> Array:
    """1 / (1 + e^-z), as scipy.special.expit computes it (e^-z overflowing to inf gives 0): numpy only, since
    importing scipy.special holds ~24 MiB in the training run's driver, whose live fit (live.py) uses this module.
    Where numpy's e^x is the C library's, the two agree bitwise; on CPUs with AVX-512 numpy uses its own vectorised
    e^x, and ~2% of values differ from scipy's by 1-4 units in the last place (measured on 10^6 normal draws)."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64)))


def sigmoid(compute: ArrayLike, A: ArrayLike, B: ArrayLike, C_mid: ArrayLike, R0: float) -> Array:
    """R(C); broadcasts, so [n, 1] parameters against [m] compute give n curves."""
    c = np.asarray(compute, dtype=np.float64)
    with np.errstate(divide="ignore"):  # C = 0 gives (C_mid / 0)^B = inf, i.e. R0
        z = np.asarray(B) * (np.log(c) - np.log(C_mid))
    return R0 + (np.asarray(A) - R0) * expit(z)


@dataclass
class Points:
    """The validated points a fit uses: compute above the cut, R, and R0."""

    compute: Array
    R: Array
    R0: float
    runs: Array | None = None
    """Which run each point comes from, when repeated runs of one recipe are fitted as one curve (None: one
    run). The fit pools them; the bootstrap resamples the runs too, so its intervals include their spread."""

    def run_slices(self) -> list[Array]:
        """Indices of each run's points, in order of compute (one entry for a single run)."""
        runs = np.zeros(self.compute.size, dtype=int) if self.runs is None else self.runs
        slices = [np.flatnonzero(runs == r) for r in np.unique(runs)]
        return [idx[np.argsort(self.compute[idx], kind="stable")] for idx in slices]


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
    A_bounds: tuple[float, float] = (0.0, 1.0)
    """The interval A was searched in (bootstrap refits keep it)."""
    warnings: list[str] = field(default_factory=list)
    """Why the fit may not be trusted: A at a bound, B huge, C_mid far outside the data, R0 not at step 0."""
    points: Points | None = field(default=None, repr=False, compare=False)
    """The points it was fitted to (what `bootstrap` resamples)."""

    def predict(self, compute: ArrayLike) -> Array:
        return sigmoid(compute, self.A, self.B, self.C_mid, self.R0)

    def jacobian(self, compute: ArrayLike) -> Array:
        """dR/d(A, log C_mid, log B) at `compute` [m, 3], without the A column when A was fixed [m, 2]."""
        x = np.array([[self.A, math.log(self.C_mid), math.log(self.B)]])
        _, jac = _model_and_jacobian(x, np.log(np.asarray(compute, dtype=np.float64)), self.R0)
        return jac[0] if self.A_bounds[0] < self.A_bounds[1] else jac[0][:, 1:]

    def efficiency(self, R: ArrayLike) -> Array:
        """F(R) = C_mid^B / ((A - R0)/(R - R0) - 1), equal to C^B on the curve: log F vs log C has slope B.
        Defined for R between R0 and A (nan elsewhere)."""
        r = np.asarray(R, dtype=np.float64)
        inside = (r - self.R0) * (self.A - r) > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            f = self.C_mid**self.B / ((self.A - self.R0) / (r - self.R0) - 1.0)
        return np.where(inside, f, np.nan)

    def as_dict(self) -> dict[str, float | int | str | list[str]]:
        return {
            "A": self.A,
            "B": self.B,
            "C_mid": self.C_mid,
            "R0": self.R0,
            "rmse": self.rmse,
            "n_points": self.n_points,
            "fit_start": self.fit_start,
            "method": self.method,
            "warnings": list(self.warnings),
        }


def prepare(
    compute: ArrayLike, R: ArrayLike, R0: float | None = None, fit_start: float = 0.0, runs: ArrayLike | None = None
) -> Points:
    """Validate the curve and cut it. Without `R0`, the lowest-compute point is R0 and is not fitted.

    `runs` (one run index per point) pools repeated runs of one recipe into one curve: R0 is then the mean
    of the runs' lowest-compute points, and each run needs `MIN_POINTS` points after the cut."""
    c = np.asarray(compute, dtype=np.float64)
    r = np.asarray(R, dtype=np.float64)
    if c.ndim != 1 or c.shape != r.shape:
        raise FitError(f"compute and R must be 1-D of equal length, got shapes {c.shape} and {r.shape}")
    if runs is not None:
        run = np.asarray(runs)
        if run.shape != c.shape:
            raise FitError(f"runs must give one run per point, got shape {run.shape} for {c.shape} points")
        if np.unique(run).size > 1:
            return _prepare_runs(c, r, R0, fit_start, run)
    bad = ~(np.isfinite(c) & np.isfinite(r))
    if bad.any():
        raise FitError(f"non-finite values at points {np.flatnonzero(bad).tolist()} (compute, R)")
    if c.size == 0:
        raise FitError("no points")
    if (c < 0).any():
        raise FitError(f"negative compute at points {np.flatnonzero(c < 0).tolist()}")
    keep = c > max(fit_start, 0.0)
    if R0 is None:
        first = int(np.argmin(c))
        R0 = float(r[first])
        keep[first] = False
    if not math.isfinite(R0):
        raise FitError(f"R0 must be finite, got {R0}")
    n = int(keep.sum())
    if n < MIN_POINTS:
        raise FitError(
            f"only {n} points after the warm-up cut (fit_start={fit_start:g}, last compute {c.max():g}); "
            f"{MIN_POINTS} are needed: lower --fit-start or wait for more evaluations"
        )
    return Points(c[keep], r[keep], float(R0))


def _prepare_runs(c: Array, r: Array, R0: float | None, fit_start: float, runs: Array) -> Points:
    ids = np.unique(runs)
    parts = []
    for j, i in enumerate(ids):  # each run validated and cut on its own
        try:
            parts.append(prepare(c[runs == i], r[runs == i], R0, fit_start))
        except FitError as exc:
            raise FitError(f"run {j + 1} of {ids.size}: {exc}") from None
    if R0 is None:
        R0 = float(np.mean([p.R0 for p in parts]))
    index = np.concatenate([np.full(p.R.size, j) for j, p in enumerate(parts)])
    return Points(np.concatenate([p.compute for p in parts]), np.concatenate([p.R for p in parts]), R0, index)


# ---------------------------------------------------------------------------------------------------------------
# Levenberg-Marquardt, batched over curves and starting points
# ---------------------------------------------------------------------------------------------------------------


def _model_and_jacobian(x: Array, logc: Array, R0: float) -> tuple[Array, Array]:
    """Curves [n, m] and their Jacobian [n, m, 3] at x = [n, 3] rows of (A, log C_mid, log B)."""
    A, u, B = x[:, :1], x[:, 1:2], np.exp(x[:, 2:3])
    z = B * (logc - u)
    s = expit(z)
    gain = A - R0
    ds = s * (1.0 - s)
    jac = np.stack([s, -gain * ds * B, gain * ds * z], axis=-1)
    return R0 + gain * s, jac


def levenberg_marquardt(
    x0: Array,
    logc: Array,
    R: Array,
    R0: float,
    lower: Array,
    upper: Array,
    free: Array | None = None,
    max_iter: int = 200,
    rtol: float = 1e-10,
) -> tuple[Array, Array, Array]:
    """Least squares for n problems at once: start rows x0 [n, 3] of (A, log C_mid, log B), data R [n, m]
    (one row per curve, or [m] shared by all starts) at log compute `logc` [m].

    Bounds are kept by projecting each step onto the box (the minima of interest are interior; a solution
    on a bound is reported by `degeneracy`). `free` masks the parameters to fit (A fixed: [F, T, T]).
    Returns (x [n, 3], sse [n], converged [n])."""
    x = np.clip(np.array(x0, dtype=np.float64), lower, upper)
    R = np.broadcast_to(R, (x.shape[0], logc.size))
    free = np.ones(3, dtype=bool) if free is None else np.asarray(free, dtype=bool)
    n = x.shape[0]
    lam = np.full(n, 1e-3)
    pred, jac = _model_and_jacobian(x, logc, R0)
    res = pred - R
    sse = (res**2).sum(-1)
    converged = np.zeros(n, dtype=bool)
    active = np.arange(n)
    eye = np.eye(int(free.sum()))
    for _ in range(max_iter):
        if active.size == 0:
            break
        J = jac[active][..., free]
        H = np.einsum("nmp,nmq->npq", J, J)
        g = np.einsum("nmp,nm->np", J, res[active])
        # Marquardt's scaling by diag(H), floored so a flat direction cannot make the system singular.
        diag = np.maximum(np.einsum("npp->np", H), 1e-12)
        step = np.linalg.solve(H + lam[active, None, None] * diag[:, :, None] * eye, -g[..., None])[..., 0]
        trial = x[active].copy()
        trial[:, free] += step
        trial = np.clip(trial, lower, upper)
        trial_pred, trial_jac = _model_and_jacobian(trial, logc, R0)
        trial_res = trial_pred - R[active]
        trial_sse = (trial_res**2).sum(-1)
        better = trial_sse < sse[active]
        gain = sse[active] - trial_sse
        idx = active[better]
        x[idx], sse[idx], res[idx], jac[idx] = trial[better], trial_sse[better], trial_res[better], trial_jac[better]
        lam[active] = np.where(better, lam[active] * 0.3, lam[active] * 10.0)
        # Done when an accepted step no longer improves, or no step near the gradient direction improves.
        done = (better & (gain <= rtol * sse[active] + 1e-30)) | (lam[active] > 1e10)
        converged[active[done]] = True
        active = active[~done]
    return x, sse, converged


# ---------------------------------------------------------------------------------------------------------------
# The two procedures
# ---------------------------------------------------------------------------------------------------------------


def a_bounds(points: Points, A_max: float = 1.0) -> tuple[float, float]:
    """A lies above R0 and the lowest fitted point (the curve rises towards A) and at most `A_max`
    (1 for a pass rate) (ours: the paper's fixed [0.45, 0.80] would exclude curves outside it)."""
    lo = max(points.R0, float(points.R.min())) + 1e-6
    if lo >= A_max:
        raise FitError(f"every point is at or above A_max={A_max:g}: no rising curve to fit")
    return lo, A_max


def search_box(points: Points, A_bounds: tuple[float, float]) -> tuple[Array, Array]:
    """Lower and upper bounds of (A, log C_mid, log B)."""
    logc = np.log(points.compute)
    lower = np.array([A_bounds[0], logc.min() - math.log(C_MID_MARGIN), math.log(B_BOUNDS[0])])
    upper = np.array([A_bounds[1], logc.max() + math.log(C_MID_MARGIN), math.log(B_BOUNDS[1])])
    return lower, upper


def _coarse_grid_starts(points: Points, lower: Array, upper: Array, A_fixed: float | None, starts: int) -> Array:
    """The `starts` best cells of a (log C_mid, log B) grid, with A at its least-squares value in each cell.

    For fixed C_mid and B the curve is linear in A, so the best A of a cell is a projection (clipped to
    its bounds): the grid needs only two dimensions (variable projection, Golub & Pereyra 1973)."""
    logc = np.log(points.compute)
    us = np.linspace(lower[1], upper[1], 48)
    Bs = np.exp(np.linspace(lower[2], upper[2], 24))
    shape = expit(Bs[None, :, None] * (logc - us[:, None, None]))  # [u, B, m]: R = R0 + (A - R0) * shape
    target = points.R - points.R0
    if A_fixed is None:
        gain = (shape * target).sum(-1) / np.maximum((shape**2).sum(-1), 1e-300)
        gain = np.clip(gain, lower[0] - points.R0, upper[0] - points.R0)
    else:
        gain = np.full(shape.shape[:2], A_fixed - points.R0)
    sse = ((gain[..., None] * shape - target) ** 2).sum(-1)
    # The best B per C_mid row, then the best rows: distinct C_mid starts guard against a local minimum.
    best_B = sse.argmin(-1)
    rows = np.argsort(sse[np.arange(us.size), best_B])[:starts]
    A = points.R0 + gain[rows, best_B[rows]]
    return np.stack([A, us[rows], np.log(Bs[best_B[rows]])], axis=-1)


def fit_fast(
    points: Points, A_fixed: float | None = None, A_max: float = 1.0, starts: int = 6, start: Fit | None = None
) -> Fit:
    """Coarse grid, then batched Levenberg-Marquardt from its `starts` best cells (or from `start`)."""
    A_bounds = (A_fixed, A_fixed) if A_fixed is not None else a_bounds(points, A_max)
    lower, upper = search_box(points, A_bounds)
    if start is not None:
        x0 = np.array([[A_fixed if A_fixed is not None else start.A, math.log(start.C_mid), math.log(start.B)]])
    else:
        x0 = _coarse_grid_starts(points, lower, upper, A_fixed, starts)
    free = np.array([A_fixed is None, True, True])
    x, sse, _ = levenberg_marquardt(x0, np.log(points.compute), points.R, points.R0, lower, upper, free)
    best = int(np.argmin(sse))
    A, C_mid, B = float(x[best, 0]), math.exp(x[best, 1]), math.exp(x[best, 2])
    rmse = math.sqrt(sse[best] / points.R.size)
    fit = Fit(A, B, C_mid, points.R0, rmse, int(points.R.size), 0.0, "fast", A_bounds, points=points)
    fit.warnings = degeneracy(fit, points, check_A=A_fixed is None)
    return fit


def fit_paper(
    points: Points,
    A_grid: Array = PAPER_A_GRID,
    C_mid_grid: Array = PAPER_C_MID_GRID,
    progress: Callable[[int], None] | None = None,
) -> Fit:
    """The paper's procedure: grid over A and C_mid, `curve_fit` for B at each grid point, least squares.
    `progress(k)` is called after each A row (k = grid points done) for a progress bar."""
    from scipy.optimize import curve_fit  # only this procedure: `megatron-rl plan` imports the package, not it

    c, r, R0 = points.compute, points.R, points.R0
    best: tuple[float, float, float, float] | None = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # curve_fit's OptimizeWarning at grid points far from the data
        for A in A_grid:
            for C_mid in C_mid_grid:
                try:
                    (B,), _ = curve_fit(
                        lambda x, b, A=A, C_mid=C_mid: sigmoid(x, A, b, C_mid, R0), c, r, p0=[1.5], maxfev=200
                    )
                except RuntimeError:  # curve_fit did not converge at this grid point
                    continue
                sse = float(((sigmoid(c, A, B, C_mid, R0) - r) ** 2).sum())
                if math.isfinite(sse) and B > 0 and (best is None or sse < best[0]):
                    best = (sse, float(A), float(B), float(C_mid))
            if progress is not None:
                progress(len(C_mid_grid))
    if best is None:
        raise FitError("the paper's grid found no converging fit")
    sse, A, B, C_mid = best
    A_bounds = (float(A_grid.min()), float(A_grid.max()))
    fit = Fit(A, B, C_mid, R0, math.sqrt(sse / c.size), int(c.size), 0.0, "paper", A_bounds, points=points)
    fit.warnings = degeneracy(fit, points)
    if C_mid in (float(C_mid_grid.min()), float(C_mid_grid.max())):
        fit.warnings.append(
            f"C_mid={C_mid:g} is at the edge of the paper's grid [{C_mid_grid.min():g}, {C_mid_grid.max():g}]"
        )
    return fit


def degeneracy(fit: Fit, points: Points, check_A: bool = True) -> list[str]:
    """Reasons not to trust a fit: parameters at their bounds or outside what the data can identify."""
    notes = []
    lo, hi = fit.A_bounds
    if check_A and min(abs(fit.A - lo), abs(fit.A - hi)) < 1e-3:
        notes.append(f"A={fit.A:.3f} is at its bound [{lo:.3f}, {hi:.3f}]: the asymptote is not identified")
    if fit.B > 10:
        notes.append(f"B={fit.B:.1f} is huge: the curve is a step; more points around C_mid are needed")
    if fit.B < 0.1:
        notes.append(f"B={fit.B:.3f} is tiny: the curve is nearly flat in log compute")
    c = points.compute
    if fit.C_mid > 10 * c.max():
        notes.append(f"C_mid={fit.C_mid:.3g} is beyond 10x the last compute {c.max():.3g}: A is a guess")
    if fit.C_mid < c.min() / 10:
        notes.append(f"C_mid={fit.C_mid:.3g} is below the first fitted compute {c.min():.3g}/10: lower --fit-start")
    return notes


def fit_curve(
    compute: ArrayLike,
    R: ArrayLike,
    R0: float | None = None,
    fit_start: float = 0.0,
    method: str = "fast",
    A_fixed: float | None = None,
    A_max: float = 1.0,
    progress: Callable[[int], None] | None = None,
    runs: ArrayLike | None = None,
) -> Fit:
    """Fit R(C) to the points above `fit_start`; R0 is the lowest-compute point's R unless given.
    `A_fixed` fits B and C_mid only (the paper's shared-A comparison); `progress` is the paper grid's;
    `runs` (a run index per point) fits repeated runs of one recipe as one curve (see `prepare`)."""
    points = prepare(compute, R, R0, fit_start, runs)
    if method == "fast":
        fit = fit_fast(points, A_fixed=A_fixed, A_max=A_max)
    elif method == "paper":
        if A_fixed is not None:
            raise FitError("A_fixed is supported by the fast method only")
        fit = fit_paper(points, progress=progress)
    else:
        raise FitError(f"method: {method!r} is not one of {list(METHODS)}")
    fit.fit_start = fit_start
    return fit
