"""Scaling-curve plots: data points, fitted curves, extrapolation and bootstrap bands, log compute axis."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_rl.scaling.compare import Result


def plot_results(
    results: list[Result], out: str | Path, predict_at: float | None = None, title: str | None = None
) -> Path:
    """One figure: every run's points, its fit (solid over the data, dashed when extrapolated) and band.
    Writes PNG (and SVG when `out` ends with .svg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, eff) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, r in enumerate(results):
        color = colors[i % len(colors)]
        c, R, f = r.curve.compute, r.curve.R, r.fit
        positive = c > 0
        used = positive & (c > f.fit_start)
        ax.scatter(c[used], R[used], s=14, color=color, alpha=0.8)
        ax.scatter(c[positive & ~used], R[positive & ~used], s=14, facecolors="none", edgecolors=color, alpha=0.6)
        hi = max(c.max(), predict_at or 0.0)
        grid = np.geomspace(max(c[positive].min(), 1e-9), hi, 200)
        inside, beyond = grid <= c.max(), grid >= c.max()
        label = f"{r.curve.label}: A={f.A:.3f}, B={f.B:.2f}, C_mid={f.C_mid:.3g}"
        ax.plot(grid[inside], f.predict(grid[inside]), color=color, lw=2, label=label)
        if beyond.sum() > 1:
            ax.plot(grid[beyond], f.predict(grid[beyond]), color=color, lw=2, ls="--")
        ax.axhline(f.A, color=color, lw=0.8, ls=":")
        if r.boot is not None:
            lo, hi_band = r.boot.predict_interval(grid)
            ax.fill_between(grid, lo, hi_band, color=color, alpha=0.15, lw=0)
        # Efficiency view: log F(R) vs log C, a line of slope B on the fitted curve.
        keep = used & (R > f.R0) & (R < f.A)
        if keep.any():
            eff.scatter(c[keep], f.efficiency(R[keep]), s=10, color=color, alpha=0.8)
            eff.plot(grid, grid**f.B, color=color, lw=1.5, label=f"{r.curve.label} (slope B={f.B:.2f})")
    if results and results[0].fit.fit_start > 0:
        ax.axvline(results[0].fit.fit_start, color="grey", lw=0.8, ls="-.", label="fit start (warm-up cut)")
    ax.set_xscale("log")
    ax.set_xlabel("compute (device-hours, log scale)")
    ax.set_ylabel("validation pass rate")
    ax.set_title(title or "RL compute-performance curves: R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    eff.set_xscale("log")
    eff.set_yscale("log")
    eff.set_xlabel("compute (device-hours)")
    eff.set_ylabel("F(R) = C_mid^B / ((A - R0)/(R - R0) - 1)")
    eff.set_title("efficiency view: slope = B", fontsize=10)
    eff.grid(True, which="both", alpha=0.3)
    eff.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    if out.suffix == ".svg":
        fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    return out
