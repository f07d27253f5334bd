"""Scaling-curve fit: speed, accuracy on the paper's Table 1, interval calibration (independent and
autocorrelated noise), paper procedure vs ours.

    OMP_NUM_THREADS=1 python benchmarks/bench_scaling_fit.py [--seeds 100] [--paper-seeds 5] [--json out.json]
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling_fit.py --only autocorrelation --seeds 100

Curves (megatron_rl/scaling/synthetic.py): Table 1 parameters (docs/recipe.md §1), R0 = 0.30, the step-0 point
plus 75 evaluations evenly spaced in compute (an evaluation every 100 steps at a constant cost per step)
up to 10 x C_mid (the math+code curves share one run: 10 x the math C_mid), Gaussian noise; warm-up cut
at the paper's 1.5k GPU-hours. A second geometry repeats the 8B run of the paper's Figure 1 (74
evaluations over 100k GPU-hours, 39 x C_mid: only a handful of points below C_mid).

Printed (markdown, pasted into benchmarks/README.md):
1. time of one fit (fast vs paper), of 1,000 bootstrap refits of one 75-point curve (batched, and for
   reference one scipy `least_squares` per refit);
2. per Table 1 row and noise level, over `--seeds` seeds: median and 95th-percentile errors of A, B,
   C_mid and of R at the final compute predicted from the first half, and the share of seeds within the
   targets (A 0.01, B 10%, C_mid 15%, prediction 0.02);
3. coverage of the 90% bootstrap intervals (A, B, C_mid, and R at the final compute fitted on the first
   half) over the same seeds, noise 0.01;
4. coverage of the 90% intervals of A, B, C_mid and of R extrapolated to 4x the last compute when the
   noise is autocorrelated from one evaluation to the next (AR(1), phi 0.5 and 0.8, as the validation
   points of one run are) and when it is not, per bootstrap method (ar, block, iid), every Table 1 row;
5. repeated runs of one recipe whose asymptotes differ from run to run (sd 0.01 around the recipe's A,
   the paper's +/-0.015 over three runs), pooled into one curve: coverage of the recipe's A, against a
   single run's interval;
6. paper procedure vs fast on `--paper-seeds` seeds per row: errors, squared-error ratio, time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from scipy.optimize import least_squares
from tqdm import tqdm

from megatron_rl.scaling import bootstrap, extrapolation_check, fit_curve, sigmoid
from megatron_rl.scaling.bootstrap import METHODS as BOOTSTRAP_METHODS
from megatron_rl.scaling.synthetic import R0, TABLE1, synthetic_curve, table1_curve

FIT_START = 1500.0
TARGETS = {"A": 0.01, "B": 0.10, "C_mid": 0.15, "R_final": 0.02}


def _timed(fn, repeat: int) -> float:
    """Median wall time of `repeat` calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _seeds(row: int, n: int, offset: int = 0) -> range:
    """Distinct noise seeds per Table 1 row, so that rows are independent trials."""
    return range(offset + 1000 * row, offset + 1000 * row + n)


def timing() -> dict[str, float]:
    compute, R = table1_curve("scalerl-8b", noise=0.01, seed=0)
    fit = fit_curve(compute, R, fit_start=FIT_START)
    points = fit.points
    t_fast = _timed(lambda: fit_curve(compute, R, fit_start=FIT_START), 20)
    t_paper = _timed(lambda: fit_curve(compute, R, fit_start=FIT_START, method="paper"), 3)
    t_boot = _timed(lambda: bootstrap(fit, n=1000), 5)

    def scipy_bootstrap(n: int = 1000) -> None:  # the straightforward loop, for reference
        rng = np.random.default_rng(0)
        fitted = fit.predict(points.compute)
        residuals = points.R - fitted
        for _ in range(n):
            sample = fitted + rng.choice(residuals, residuals.size)
            least_squares(
                lambda x, s=sample: sigmoid(points.compute, x[0], x[1], x[2], R0) - s,
                [fit.A, fit.B, fit.C_mid],
                bounds=([R0, 0.05, 1.0], [1.0, 20.0, 1e7]),
                x_scale=[0.1, 1.0, 1000.0],
            )

    t_scipy = _timed(scipy_bootstrap, 1)
    return {"fit_fast_s": t_fast, "fit_paper_s": t_paper, "bootstrap_1000_s": t_boot, "scipy_1000_s": t_scipy}


def recovery(seeds: int, noise: float, geometry: str = "table1") -> dict[str, dict[str, float]]:
    """Per row: errors over seeds of the full fit and of the final R predicted from the first half."""
    out = {}
    for row, (name, (C_mid, B, A)) in enumerate(tqdm(TABLE1.items(), desc=f"recovery noise {noise}", leave=False)):
        errors = []
        for seed in _seeds(row, seeds):
            if geometry == "figure1":  # the 8B run of Figure 1: 74 evaluations over 100k GPU-hours
                compute, R = synthetic_curve(A, B, C_mid, noise=noise, seed=seed, points=74, max_compute=1e5)
            else:
                compute, R = table1_curve(name, noise=noise, seed=seed)
            fit = fit_curve(compute, R, fit_start=FIT_START)
            half = compute <= compute.max() / 2
            head = fit_curve(compute[half], R[half], fit_start=FIT_START)
            truth = sigmoid([compute.max()], A, B, C_mid, R0)[0]
            errors.append(
                [
                    abs(fit.A - A),
                    abs(fit.B / B - 1),
                    abs(fit.C_mid / C_mid - 1),
                    abs(head.predict([compute.max()])[0] - truth),
                ]
            )
        e = np.array(errors)
        row = {"span": float(compute.max() / C_mid)}
        for j, key in enumerate(TARGETS):
            row[f"{key}_median"] = float(np.median(e[:, j]))
            row[f"{key}_p95"] = float(np.quantile(e[:, j], 0.95))
            row[f"{key}_pass"] = float(np.mean(e[:, j] <= TARGETS[key]))
        out[name] = row
    return out


def calibration(seeds: int, noise: float, n_boot: int = 200) -> dict[str, dict[str, float]]:
    out = {}
    for row, (name, (C_mid, B, A)) in enumerate(tqdm(TABLE1.items(), desc="calibration", leave=False)):
        covered = {"A": 0, "B": 0, "C_mid": 0, "R_final": 0}
        for seed in _seeds(row, seeds, offset=50_000):
            compute, R = table1_curve(name, noise=noise, seed=seed)
            boot = bootstrap(fit_curve(compute, R, fit_start=FIT_START), n=n_boot, seed=seed)
            for key, value in (("A", A), ("B", B), ("C_mid", C_mid)):
                lo, hi = boot.interval(key)
                covered[key] += lo <= value <= hi
            check = extrapolation_check(compute, R, compute.max() / 2, FIT_START, n_boot=n_boot, seed=seed)
            lo, hi = check.boot.predict_interval([compute.max()])
            covered["R_final"] += lo[0] <= sigmoid([compute.max()], A, B, C_mid, R0)[0] <= hi[0]
        out[name] = {key: n / seeds for key, n in covered.items()}
    return out


AR_PHIS = (0.0, 0.5, 0.8)
EXTRAPOLATE = 4.0
"""Autocorrelation section: R is predicted at this multiple of the last compute."""


def autocorrelation(seeds: int, noise: float, n_boot: int = 200) -> dict[str, dict[str, dict[str, float]]]:
    """Coverage per noise kind (phi) and bootstrap method, per Table 1 row: {phi: {method: {row: ...}}}."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    bar = tqdm(total=len(AR_PHIS) * len(TABLE1) * seeds, desc="autocorrelation", leave=False)
    for phi in AR_PHIS:
        cells = {method: {} for method in BOOTSTRAP_METHODS}
        for row, (name, (C_mid, B, A)) in enumerate(TABLE1.items()):
            truth = {"A": A, "B": B, "C_mid": C_mid}
            covered = {method: dict.fromkeys([*truth, "R_4x"], 0) for method in BOOTSTRAP_METHODS}
            for seed in _seeds(row, seeds, offset=90_000):
                compute, R = table1_curve(name, noise=noise, seed=seed, phi=phi)
                fit = fit_curve(compute, R, fit_start=FIT_START)
                far = EXTRAPOLATE * compute.max()
                R_far = sigmoid([far], A, B, C_mid, R0)[0]
                for method in BOOTSTRAP_METHODS:
                    boot = bootstrap(fit, n=n_boot, seed=seed, method=method)
                    for key, value in truth.items():
                        lo, hi = boot.interval(key)
                        covered[method][key] += lo <= value <= hi
                    lo, hi = boot.predict_interval([far])
                    covered[method]["R_4x"] += lo[0] <= R_far <= hi[0]
                bar.update(1)
            for method in BOOTSTRAP_METHODS:
                cells[method][name] = {key: n / seeds for key, n in covered[method].items()}
        out[str(phi)] = cells
    bar.close()
    return out


RUN_COUNTS = (1, 2, 3, 5)
RUN_TO_RUN_SD = (0.0, 0.01)


def repeated_runs(seeds: int, n_boot: int = 200, phi: float = 0.5) -> dict[str, dict[str, float]]:
    """The scalerl-8b row run k times, each run's A drawn around the recipe's (sd 0.0 or 0.01), AR(1) noise:
    coverage of the recipe's A by the pooled curve's 90% interval, and its median width."""
    C_mid, B, A = TABLE1["scalerl-8b"]
    out = {}
    bar = tqdm(total=len(RUN_COUNTS) * len(RUN_TO_RUN_SD) * seeds, desc="repeated runs", leave=False)
    for sd in RUN_TO_RUN_SD:
        for k in RUN_COUNTS:
            covered, widths = 0, []
            for seed in range(seeds):
                rng = np.random.default_rng(seed)
                runs = [
                    synthetic_curve(a, B, C_mid, noise=0.01, seed=100 * seed + j, max_compute=10 * C_mid, phi=phi)
                    for j, a in enumerate(A + rng.normal(0.0, sd, k))
                ]
                compute = np.concatenate([c for c, _ in runs])
                R = np.concatenate([r for _, r in runs])
                index = np.repeat(np.arange(k), runs[0][0].size)
                fit = fit_curve(compute, R, fit_start=FIT_START, runs=index)
                lo, hi = bootstrap(fit, n=n_boot, seed=seed).interval("A")
                covered += lo <= A <= hi
                widths.append(hi - lo)
                bar.update(1)
            out[f"sd {sd}, {k} runs"] = {"coverage": covered / seeds, "width": float(np.median(widths))}
    bar.close()
    return out


def paper_vs_fast(seeds: int, noise: float) -> dict[str, dict[str, float]]:
    out = {}
    bar = tqdm(total=len(TABLE1) * seeds, desc="paper vs fast", leave=False)
    for row, (name, (C_mid, B, A)) in enumerate(TABLE1.items()):
        rows = []
        for seed in _seeds(row, seeds):
            compute, R = table1_curve(name, noise=noise, seed=seed)
            start = time.perf_counter()
            fast = fit_curve(compute, R, fit_start=FIT_START)
            t_fast = time.perf_counter() - start
            start = time.perf_counter()
            paper = fit_curve(compute, R, fit_start=FIT_START, method="paper")
            t_paper = time.perf_counter() - start
            rows.append(
                [
                    abs(fast.A - A),
                    abs(paper.A - A),
                    abs(fast.B / B - 1),
                    abs(paper.B / B - 1),
                    abs(fast.C_mid / C_mid - 1),
                    abs(paper.C_mid / C_mid - 1),
                    (fast.rmse / paper.rmse) ** 2,
                    t_fast,
                    t_paper,
                ]
            )
            bar.update(1)
        m = np.array(rows)
        keys = ["A_fast", "A_paper", "B_fast", "B_paper", "C_fast", "C_paper", "sse_ratio", "t_fast", "t_paper"]
        out[name] = dict(zip(keys, np.median(m, axis=0).tolist(), strict=True))
        out[name]["sse_ratio_max"] = float(m[:, 6].max())
    bar.close()
    return out


def _print_recovery(title: str, rec: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}\n")
    print(
        "| run | span x C_mid | A err median / p95 | B rel. err median / p95 | C_mid rel. err median / p95 "
        "| R(final) from half, err median / p95 | seeds within A / B / C_mid / R targets |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rec.items():
        passes = " / ".join(f"{r[f'{k}_pass']:.0%}" for k in TARGETS)
        print(
            f"| {name} | {r['span']:.0f} | {r['A_median']:.4f} / {r['A_p95']:.4f} | {r['B_median']:.1%} / "
            f"{r['B_p95']:.1%} | {r['C_mid_median']:.1%} / {r['C_mid_p95']:.1%} | {r['R_final_median']:.4f} / "
            f"{r['R_final_p95']:.4f} | {passes} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--paper-seeds", type=int, default=5, help="seeds per row for the (slow) paper procedure")
    parser.add_argument("--json", default=None, help="also write every number here")
    parser.add_argument("--boot", type=int, default=200, help="refits per bootstrap in the coverage sections")
    choices = ["timing", "recovery", "calibration", "autocorrelation", "runs", "paper"]
    parser.add_argument("--only", choices=choices, default=None)
    args = parser.parse_args()
    sections = [args.only] if args.only else choices

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"numpy {np.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )
    results: dict[str, object] = {}
    if "timing" in sections:
        results["timing"] = _report_timing()
    if "recovery" in sections:
        results.update(_report_recovery(args.seeds))
    if "calibration" in sections:
        results["calibration_0.01"] = _report_calibration(args.seeds, args.boot)
    if "autocorrelation" in sections:
        results["autocorrelation_0.01"] = _report_autocorrelation(args.seeds, args.boot)
    if "runs" in sections:
        results["repeated_runs"] = _report_repeated_runs(args.seeds, args.boot)
    if "paper" in sections:
        results["paper_vs_fast_0.01"] = _report_paper(args.paper_seeds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _report_timing() -> dict[str, float]:
    t = timing()
    print("\n| what (75-point curve) | time |")
    print("|---|---:|")
    print(f"| one fit, fast (ours) | {t['fit_fast_s'] * 1e3:.1f} ms |")
    print(f"| one fit, paper's grid (7,100 `curve_fit` calls) | {t['fit_paper_s']:.2f} s |")
    print(f"| 1,000 bootstrap refits, batched (ours) | {t['bootstrap_1000_s']:.3f} s |")
    print(f"| 1,000 bootstrap refits, one scipy `least_squares` each (reference) | {t['scipy_1000_s']:.2f} s |")
    return t


def _report_recovery(seeds: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for noise in (0.005, 0.01):
        rec = recovery(seeds, noise)
        results[f"recovery_{noise}"] = rec
        _print_recovery(f"Recovery, Table 1 curves, noise {noise}, {seeds} seeds", rec)
    fig1 = recovery(seeds, 0.01, geometry="figure1")
    results["recovery_figure1_0.01"] = fig1
    title = f"Recovery, Figure 1 geometry (74 evaluations over 100k GPU-hours), noise 0.01, {seeds} seeds"
    _print_recovery(title, fig1)
    return results


def _report_calibration(seeds: int, n_boot: int) -> dict[str, dict[str, float]]:
    cal = calibration(seeds, 0.01, n_boot)
    print(f"\nCoverage of the 90% bootstrap intervals (default method), noise 0.01, {seeds} seeds, {n_boot} refits\n")
    print("| run | A | B | C_mid | R(final) fitted on the first half |")
    print("|---|---:|---:|---:|---:|")
    for name, c in cal.items():
        print(f"| {name} | {c['A']:.0%} | {c['B']:.0%} | {c['C_mid']:.0%} | {c['R_final']:.0%} |")
    mean = {k: float(np.mean([c[k] for c in cal.values()])) for k in ("A", "B", "C_mid", "R_final")}
    print(f"| all rows | {mean['A']:.1%} | {mean['B']:.1%} | {mean['C_mid']:.1%} | {mean['R_final']:.1%} |")
    return cal


def _report_autocorrelation(seeds: int, n_boot: int) -> dict[str, dict[str, dict[str, float]]]:
    cov = autocorrelation(seeds, 0.01, n_boot)
    keys = ("A", "B", "C_mid", "R_4x")
    trials = seeds * len(TABLE1)
    print(
        f"\nCoverage of the 90% intervals, noise sd 0.01, every Table 1 row x {seeds} seeds ({trials} curves per "
        f"cell), {n_boot} refits: all rows pooled (lowest row)\n"
    )
    print(f"| noise | method | A | B | C_mid | R at {EXTRAPOLATE:g}x the last compute |")
    print("|---|---|---:|---:|---:|---:|")
    for phi, cells in cov.items():
        kind = "independent" if float(phi) == 0 else f"AR(1), phi {phi}"
        for method, rows in cells.items():
            pooled = [float(np.mean([r[k] for r in rows.values()])) for k in keys]
            lowest = [min(r[k] for r in rows.values()) for k in keys]
            text = " | ".join(f"{p:.1%} ({lo:.0%})" for p, lo in zip(pooled, lowest, strict=True))
            print(f"| {kind} | {method} | {text} |")
    return cov


def _report_repeated_runs(seeds: int, n_boot: int) -> dict[str, dict[str, float]]:
    rep = repeated_runs(seeds, n_boot)
    print(
        f"\nRepeated runs pooled into one curve (scalerl-8b, AR(1) noise phi 0.5 sd 0.01), {seeds} seeds: coverage "
        "of the recipe's A by the 90% interval (median width)\n"
    )
    print("| run-to-run sd of A | " + " | ".join(f"{k} run{'s' * (k > 1)}" for k in RUN_COUNTS) + " |")
    print("|---|" + "---:|" * len(RUN_COUNTS))
    for sd in RUN_TO_RUN_SD:
        cells = [rep[f"sd {sd}, {k} runs"] for k in RUN_COUNTS]
        print(f"| {sd} | " + " | ".join(f"{c['coverage']:.0%} ({c['width']:.3f})" for c in cells) + " |")
    return rep


def _report_paper(seeds: int) -> dict[str, dict[str, float]]:
    pvf = paper_vs_fast(seeds, 0.01)
    print(f"\nPaper procedure vs fast, noise 0.01, median over {seeds} seeds per row\n")
    print(
        "| run | A err fast / paper | B rel. err fast / paper | C_mid rel. err fast / paper "
        "| SSE fast / paper (median, max) | time fast / paper |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, p in pvf.items():
        print(
            f"| {name} | {p['A_fast']:.4f} / {p['A_paper']:.4f} | {p['B_fast']:.1%} / {p['B_paper']:.1%} | "
            f"{p['C_fast']:.1%} / {p['C_paper']:.1%} | {p['sse_ratio']:.3f}, {p['sse_ratio_max']:.3f} | "
            f"{p['t_fast'] * 1e3:.0f} ms / {p['t_paper']:.1f} s |"
        )
    return pvf


if __name__ == "__main__":
    main()
