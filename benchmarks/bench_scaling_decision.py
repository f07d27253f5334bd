"""Calibration of the scaling decision (megatron_rl/scaling/decision.py) on curves with known parameters.

    OMP_NUM_THREADS=1 python benchmarks/bench_scaling_decision.py [--seeds 200] [--boot 500] [--json out.json]

Two configurations, as a batch-size comparison looks (R0 = 0.30): "small" rises early to a lower ceiling
(A 0.61, B 2.2, C_mid 6,000), "large" rises later to a higher one (A 0.70, B 1.5, C_mid 15,000); the true
curves cross at 31,857 (beyond the data). Each run is observed as the paper's runs are: the step-0 point
plus 60 evaluations evenly spaced up to 20,000, with AR(1) evaluation noise (sd 0.01; phi 0.3, 0.6, 0.8:
the validation points of one run are autocorrelated). A third "close" configuration (A 0.63, otherwise as
"small") checks the difference where it is small and the curves never cross.

Per noise level, over `--seeds` pairs of runs, each fitted and bootstrapped (AR method, `--boot` refits):
- coverage of the stated 90% interval of R_small - R_large (and R_small - R_close) by the true difference at
  15,000 (inside the data), 50,000 and 100,000 (extrapolated);
- how often the run called ahead with P >= 0.9 is the truly ahead one (should be >= 0.9);
- coverage of the 90% crossover interval (over [5,000, 1,000,000]) by the true crossover, and its median
  width in octaves.

The target (issue text): the 90% interval of the difference covers the truth 80-98% of the time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import numpy as np
from scipy.optimize import brentq
from tqdm import tqdm

from megatron_rl.scaling.compare import fit_run
from megatron_rl.scaling.curves import Curve
from megatron_rl.scaling.decision import crossover, difference
from megatron_rl.scaling.fit import sigmoid
from megatron_rl.scaling.synthetic import R0, synthetic_curve

SMALL = (0.61, 2.2, 6000.0)
LARGE = (0.70, 1.5, 15000.0)
CLOSE = (0.63, 2.2, 6000.0)
MAX_COMPUTE, POINTS, NOISE = 20000.0, 60, 0.01
AT = (15000.0, 50000.0, 100000.0)
RANGE = (5000.0, 1e6)
PHIS = (0.3, 0.6, 0.8)


def true_R(params: tuple[float, float, float], c: float) -> float:
    return float(sigmoid(np.array([c]), *params, R0)[0])


def true_crossover() -> float:
    gap = lambda lc: true_R(SMALL, math.exp(lc)) - true_R(LARGE, math.exp(lc))  # noqa: E731
    return math.exp(brentq(gap, math.log(RANGE[0]), math.log(RANGE[1])))


def _run(label: str, params: tuple[float, float, float], seed: int, phi: float, boot: int):
    c, R = synthetic_curve(*params, noise=NOISE, seed=seed, points=POINTS, max_compute=MAX_COMPUTE, phi=phi)
    return fit_run(Curve(label, c, R, label), n_boot=boot, seed=seed)


def evaluate(phi: float, seeds: int, boot: int) -> dict[str, float]:
    truth_cross = true_crossover()
    covered = {f"{pair}@{c:g}": [] for pair in ("large", "close") for c in AT}
    confident_right, confident = 0, 0
    cross_cover, widths = [], []
    for seed in tqdm(range(seeds), desc=f"phi {phi}", leave=False):
        small = _run("small", SMALL, 3 * seed, phi, boot)
        large = _run("large", LARGE, 3 * seed + 1, phi, boot)
        close = _run("close", CLOSE, 3 * seed + 2, phi, boot)
        for name, other, params in (("large", large, LARGE), ("close", close, CLOSE)):
            for c in AT:
                d = difference(small, other, c)
                true = true_R(SMALL, c) - true_R(params, c)
                covered[f"{name}@{c:g}"].append(d.interval[0] <= true <= d.interval[1])
                for p, ahead in ((d.p_a_ahead, true > 0), (1 - d.p_a_ahead, true < 0)):
                    if p >= 0.9:
                        confident += 1
                        confident_right += ahead
        cross = crossover(small, large, RANGE)
        if cross.interval is not None:
            lo, hi = cross.interval
            cross_cover.append(lo <= truth_cross <= hi)
            if math.isfinite(lo) and math.isfinite(hi):
                widths.append(math.log2(hi / lo))
        else:
            cross_cover.append(False)
    out = {key: float(np.mean(v)) for key, v in covered.items()}
    out["confident_right"] = confident_right / max(confident, 1)
    out["confident_calls"] = confident / (seeds * 2 * len(AT))
    out["crossover_coverage"] = float(np.mean(cross_cover))
    out["crossover_width_octaves"] = float(np.median(widths)) if widths else math.nan
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--boot", type=int, default=500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; true crossover "
          f"{true_crossover():,.0f}; {args.seeds} seeds, {args.boot} refits")  # fmt: skip
    rows = {phi: evaluate(phi, args.seeds, args.boot) for phi in PHIS}
    head = ["phi", *[f"diff {p}@{c / 1000:g}k" for p in ("large", "close") for c in AT]]
    head += ["P>=0.9 right", "crossover cover", "width (octaves)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for phi, r in rows.items():
        cells = [f"{phi}", *[f"{r[f'{p}@{c:g}']:.0%}" for p in ("large", "close") for c in AT]]
        cells += [
            f"{r['confident_right']:.0%}",
            f"{r['crossover_coverage']:.0%}",
            f"{r['crossover_width_octaves']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in rows.items()}, f, indent=2)


if __name__ == "__main__":
    main()
