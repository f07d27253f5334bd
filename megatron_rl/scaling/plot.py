"""The scaling figure, in the style of the paper's Figures 1, 9 and 10: every run's validation points on a
log-compute axis, its fitted curve (solid over the fitted range, dashed where extrapolated), the
bootstrap band, the asymptote A, and optionally the efficiency view log F(R) vs log C (slope B).

When a run has an extrapolation check, the curve drawn is the one fitted up to the cut, and the points
beyond the cut are drawn as held out (the paper's "fit to 50k, predict 100k").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_rl.scaling.compare import Result
from megatron_rl.scaling.curves import Curve
from megatron_rl.scaling.decision import Decision
from megatron_rl.scaling.fit import Fit


def _palette(n: int, ordered: bool) -> list:
    import matplotlib

    if ordered and n > 1:  # a scaling axis: a sequential map makes the order visible
        cmap = matplotlib.colormaps["viridis"]
        return [cmap(0.78 * i / (n - 1)) for i in range(n)]
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    return [colors[i % len(colors)] for i in range(n)]


def plot_results(
    results: list[Result],
    out: str | Path,
    predict_at: list[float] | None = None,
    title: str | None = None,
    ylabel: str = "validation pass rate",
    xlabel: str = "compute (device-hours)",
    efficiency: bool = True,
    ordered: bool = False,
    efficiency_fits: dict[str, Fit] | None = None,
    axis: str | None = None,
    unfitted: list[Curve] | None = None,
    crossovers: list[Decision] | None = None,
) -> list[Path]:
    """Write the figure to `out` (.png, or .svg plus a .png next to it); returns the files written.
    `efficiency_fits` (label -> fit) replaces runs' own fits in the efficiency view, e.g. by their
    shared-A refits, so that the slopes compare B at one asymptote as the paper does. With `axis` (a label
    key such as `labels.batch`), legends read `batch=512`. `unfitted` curves (no fit could be made) are drawn
    as their points only, marked "not fitted" in the legend. `crossovers` (decisions) whose verdict is a
    crossover are marked at C* with its interval shaded; other verdicts draw nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    predict_at = predict_at or []
    if efficiency:
        fig, (ax, eff) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(8.5, 5.2))
        eff = None
    unfitted = unfitted or []
    colors = _palette(len(results) + len(unfitted), ordered)
    x_max = max([float(c.compute.max()) for c in [r.curve for r in results] + unfitted] + predict_at)
    for color, r in zip(colors, results, strict=False):
        name = f"{axis.rsplit('.', 1)[-1]}={r.curve.label}" if axis else r.curve.label
        _draw_run(ax, r, name, color, x_max, predict_at)
        if eff is not None:
            _draw_efficiency(eff, r, name, color, (efficiency_fits or {}).get(r.curve.label))
    for color, curve in zip(colors[len(results) :], unfitted, strict=True):
        name = f"{axis.rsplit('.', 1)[-1]}={curve.label}" if axis else curve.label
        ax.scatter(curve.compute, curve.R, s=16, marker="s", color=color, alpha=0.85, zorder=3)
        ax.plot([], [], marker="s", ls="none", color=color, label=f"{name}: not fitted")
    fit_starts = {r.fit.fit_start for r in results}
    if len(fit_starts) == 1 and (fit_start := fit_starts.pop()) > 0:
        ax.axvline(fit_start, color="0.5", lw=0.9, ls="-.", label=f"fit start {fit_start:g} (warm-up cut)")
    for c in predict_at:
        ax.axvline(c, color="0.3", lw=0.8, ls=":")
    for cross in crossovers or []:
        if cross.verdict != "crossover" or cross.crossover is None or cross.crossover_interval is None:
            continue
        ax.axvline(cross.crossover, color="black", lw=1.1, ls="--", label=f"crossover: {cross.describe()}")
        lo, hi = (max(cross.crossover_interval[0], cross.start), min(cross.crossover_interval[1], cross.target))
        ax.axvspan(lo, hi, color="0.5", alpha=0.1, lw=0)
    ax.set_xscale("log")
    ax.set_xlabel(f"{xlabel}, log scale")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)", fontsize=11)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    if eff is not None:
        eff.set_xscale("log")
        eff.set_yscale("log")
        eff.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # within a decade they collide
        eff.set_xlabel(f"{xlabel}, log scale")
        eff.set_ylabel("F(R) = C_mid^B / ((A - R0) / (R - R0) - 1)")
        eff.set_title("efficiency view: log F(R) vs log C has slope B", fontsize=11)
        eff.grid(True, which="major", alpha=0.35)
        if eff.get_legend_handles_labels()[0]:  # no fitted curve, no efficiency line
            eff.legend(fontsize=8, loc="upper left", framealpha=0.9)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = [out]
    fig.savefig(out, dpi=110)
    if out.suffix.lower() == ".svg":
        written.append(out.with_suffix(".png"))
        fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def _draw_run(ax, r: Result, name: str, color, x_max: float, predict_at: list[float]) -> None:
    c, R = r.curve.compute, r.curve.R
    check = r.extrapolation
    fit, boot = (check.fit, check.boot) if check is not None else (r.fit, r.boot)
    cut = check.cut if check is not None else np.inf
    positive = c > 0
    # Filled: the points fitted; hollow: warm-up and the R0 point; crosses: held out beyond the cut.
    fitted = positive & (c <= cut)
    if fit.points is not None:
        fitted &= np.isin(c, fit.points.compute)
    warmup = positive & ~fitted & (c <= cut)
    heldout = c > cut
    ax.scatter(c[fitted], R[fitted], s=16, color=color, alpha=0.85, zorder=3)
    for compute, step, fields in r.curve.changes:  # a resume changed the config here: the curve spans both
        what = ", ".join(field.rsplit(".", 1)[-1] for field in fields)
        ax.axvline(compute, color=color, lw=0.9, ls=(0, (1, 2)), label=f"{name}: config change at step {step} ({what})")
    ax.scatter(c[warmup], R[warmup], s=16, facecolors="none", edgecolors=color, alpha=0.7, zorder=3)
    if heldout.any():
        ax.scatter(c[heldout], R[heldout], s=22, marker="x", color=color, alpha=0.85, zorder=3)

    grid = np.geomspace(c[positive].min(), x_max * 1.05, 300)
    data_end = min(float(c.max()), cut)
    inside, beyond = grid <= data_end, grid >= data_end
    interval = boot.interval("A") if boot is not None else None
    A_text = f"A={fit.A:.3f}" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
    label = f"{name}: {A_text}, B={fit.B:.2f}, C_mid={compact(fit.C_mid)}"
    if check is not None:
        label += f" (fit to {compact(cut)})"
    ax.plot(grid[inside], fit.predict(grid[inside]), color=color, lw=2, label=label, zorder=2)
    if beyond.sum() > 1:
        ax.plot(grid[beyond], fit.predict(grid[beyond]), color=color, lw=2, ls="--", zorder=2)
    if boot is not None:
        lo, hi = boot.predict_interval(grid)
        ax.fill_between(grid, lo, hi, color=color, alpha=0.15, lw=0, zorder=1)
    ax.axhline(fit.A, color=color, lw=0.8, ls=":", alpha=0.8)
    for at in predict_at:
        value = float(fit.predict([at])[0])
        if boot is not None:
            lo, hi = boot.predict_interval([at])
            ax.errorbar([at], [value], yerr=[[value - lo[0]], [hi[0] - value]], color=color, capsize=3, lw=1)
        ax.scatter([at], [value], marker="*", s=90, color=color, edgecolors="black", linewidths=0.5, zorder=4)


def compact(x: float) -> str:
    """Compute for labels: 2,542 / 11,272 / 0.37."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _draw_efficiency(eff, r: Result, name: str, color, fit: Fit | None = None) -> None:
    fit = fit or r.fit
    points = fit.points
    if points is None:
        return
    # F(R) divides the noise by the gain still to come, which vanishes near A: show the part of the run where
    # the fitted curve is between 5% and 90% of its gain (selecting on the observed R would bias the points).
    share = (fit.predict(points.compute) - fit.R0) / (fit.A - fit.R0)
    informative = (share > 0.05) & (share < 0.9)
    if informative.sum() < 2:
        return
    F = fit.efficiency(points.R)
    keep = informative & np.isfinite(F) & (F > 0)
    eff.scatter(points.compute[keep], F[keep], s=10, color=color, alpha=0.75)
    c = points.compute[informative]
    grid = np.geomspace(c.min(), c.max(), 100)
    shared = f", shared A={fit.A:.3f}" if fit is not r.fit else ""
    eff.plot(grid, grid**fit.B, color=color, lw=1.6, label=f"{name}: slope B={fit.B:.2f}{shared}")
