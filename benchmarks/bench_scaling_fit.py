"""Scaling-curve fit: speed (1,000 bootstrap refits; paper vs fast procedure), accuracy on Table 1, calibration.

    python benchmarks/bench_scaling_fit.py [--seeds 100] [--plot docs/scaling_example.png]

Curves: the paper's Table 1 parameters (SCALERL.md §1), 75 evaluations evenly spaced up to 20 x C_mid plus
the step-0 point, Gaussian noise 0.01, warm-up cut min(1500, C_mid / 2).
"""

from __future__ import annotations

import argparse
import time

from megatron_rl.scaling.compare import Result
from megatron_rl.scaling.curves import Curve
from megatron_rl.scaling.fit import bootstrap, extrapolation_check, fit_curve, sigmoid
from megatron_rl.scaling.synthetic import R0, TABLE1, synthetic_curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--noise", type=float, default=0.01)
    parser.add_argument("--plot", default=None, help="also write an example figure (three Table-1 runs)")
    args = parser.parse_args()

    c, r = synthetic_curve(0.610, 1.92, 2542, noise=args.noise, seed=0)
    start = time.perf_counter()
    fast = fit_curve(c, r, fit_start=1500)
    t_fast = time.perf_counter() - start
    start = time.perf_counter()
    paper = fit_curve(c, r, fit_start=1500, method="paper")
    t_paper = time.perf_counter() - start
    start = time.perf_counter()
    bootstrap(c, r, fast, n=1000)
    t_boot = time.perf_counter() - start
    print("timing (75-point curve)")
    print(f"  fast fit             {t_fast * 1e3:8.1f} ms   A={fast.A:.4f} B={fast.B:.3f} C_mid={fast.C_mid:.0f}")
    print(f"  paper fit (grid)     {t_paper * 1e3:8.1f} ms   A={paper.A:.4f} B={paper.B:.3f} C_mid={paper.C_mid:.0f}")
    print(f"  1,000 bootstraps     {t_boot:8.2f} s    (target < 10 s)")

    print(
        f"\nrecovery on Table 1 (noise {args.noise}, seed 0): error of A, relative error of B and C_mid, extrapolation"
    )
    print(f"  {'run':<16}{'dA':>9}{'dB/B':>9}{'dC/C':>9}{'R(end) from half':>20}")
    for name, (C_mid, B, A) in TABLE1.items():
        c, r = synthetic_curve(A, B, C_mid, noise=args.noise, seed=0)
        fit_start = min(1500.0, C_mid / 2)
        f = fit_curve(c, r, fit_start=fit_start)
        e = extrapolation_check(c, r, cut=c.max() / 2, fit_start=fit_start, n_boot=100)
        truth = float(sigmoid([c.max()], A, B, C_mid, R0)[0])
        print(
            f"  {name:<16}{f.A - A:>+9.4f}{f.B / B - 1:>+9.3f}{f.C_mid / C_mid - 1:>+9.3f}{e.predicted - truth:>+20.4f}"
        )

    print(f"\ncalibration of the 90% bootstrap interval over {args.seeds} seeds (scalerl-8b parameters, 300 refits)")
    C_mid, B, A = TABLE1["scalerl-8b"]
    hits = {"A": 0, "B": 0, "C_mid": 0}
    for seed in range(args.seeds):
        c, r = synthetic_curve(A, B, C_mid, noise=args.noise, seed=1000 + seed)
        f = fit_curve(c, r, fit_start=1500)
        boot = bootstrap(c, r, f, n=300, seed=seed)
        for name, truth in (("A", A), ("B", B), ("C_mid", C_mid)):
            lo, hi = boot.interval(name)
            hits[name] += lo <= truth <= hi
    for name, count in hits.items():
        print(f"  {name:<6} covered in {count / args.seeds:.0%} of seeds (target 80-98%)")

    if args.plot:
        from megatron_rl.scaling.plot import plot_results

        results = []
        for name in ("scalerl-8b", "moe-17bx16", "multitask-code"):
            C_mid, B, A = TABLE1[name]
            c, r = synthetic_curve(A, B, C_mid, noise=0.008, seed=3, points=75, span=6)
            f = fit_curve(c, r, fit_start=1500)
            results.append(Result(Curve(name, c, r, "synthetic"), f, bootstrap(c, r, f, n=300)))
        title = "Table-1-like synthetic runs: fit to the data, extrapolate to 100k"
        print(f"\nwrote {plot_results(results, args.plot, predict_at=1e5, title=title)}")


if __name__ == "__main__":
    main()
