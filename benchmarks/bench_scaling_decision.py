"""Calibration of the scaling decision (megatron_rl/scaling/decision.py) on curves with known parameters.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bench_scaling_decision.py [--seeds 200] [--boot 200] [--json out]
    OMP_NUM_THREADS=1 python benchmarks/bench_scaling_decision.py --part coverage [--seeds 300] [--boot 1000]

**Verdicts** (`--part verdicts`, the default): `decide_pair` (winner / undecided / crossover, 90%) on pairs of
synthetic runs from known curves (R0 = 0.30; the step-0 point plus 75 evaluations evenly spaced up to the
case's budget; AR(1) evaluation noise, sd 0.01, phi 0.6). Unless a case says otherwise each run's A is drawn
around its recipe's with sd `run_sd(0.02)` = 0.0086 (two runs of one recipe within 0.02 of each other 90% of the
time, the paper's margin: its three repeated runs gave A within +/-0.015), since repeated runs differ by more
than their evaluation noise. Cases (`CASES`): the same curve with and without that run-to-run variation (decided
with `margin` 0, the bootstrap alone, and with the default 0.02), real crossovers inside and beyond the data
(Table 1's 8B vs MoE and batch 512 vs 2048), one curve better everywhere, and A differing by 0.01 and 0.03. Each
at two targets: the last evaluation and 4x it. Per case and target, over `--seeds` pairs: the share of winner /
undecided / crossover verdicts, and of right and wrong calls. Right: the run named ahead at the target is the
one whose recipe curve is ahead there, and for a crossover also: the recipe curves change order within
[start, target] with the last change inside the stated interval of C*. Wrong: any other winner or crossover
(on the same curve, every one). Target: at most 10% wrong on the same curve. Cases "pooled" fit 2 or 3 runs per
side as one curve, as `megatron-rl fit a=r1.jsonl a=r2.jsonl b=...` does.

**Coverage** (`--part coverage`): two configurations shaped like a batch-size comparison (R0 = 0.30): "small"
rises early to a lower ceiling (A 0.61, B 2.2, C_mid 6,000), "large" rises later to a higher one (A 0.70, B 1.5,
C_mid 15,000); the true curves cross at 31,857 (beyond the data). Each run is observed as the step-0 point plus
60 evaluations evenly spaced up to 20,000, with AR(1) evaluation noise (sd 0.01; phi 0.3, 0.6, 0.8). A third
"close" configuration (A 0.63, otherwise as "small") checks the difference where it is small and the curves
never cross. Per noise level, over `--seeds` pairs of runs, each fitted and bootstrapped (AR method, `--boot`
refits): coverage of the stated 90% interval of R_small - R_large (and R_small - R_close) by the true difference
at 15,000 (inside the data), 50,000 and 100,000 (extrapolated); how often the run called ahead with P >= 0.9 is
the truly ahead one; coverage of the 90% crossover interval (over [5,000, 1,000,000]) by the true crossover, and
its median width in octaves. Target: the 90% interval of the difference covers the truth 80-98% of the time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from tqdm import tqdm

from megatron_rl.scaling.compare import fit_run
from megatron_rl.scaling.curves import Curve, pool_runs
from megatron_rl.scaling.decision import MARGIN, Decision, crossover, decide_pair, difference, run_sd
from megatron_rl.scaling.fit import sigmoid
from megatron_rl.scaling.synthetic import R0, TABLE1, synthetic_curve

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


# ---------------------------------------------------------------------------------------------------------------
# Verdicts: winner / undecided / crossover against the known truth
# ---------------------------------------------------------------------------------------------------------------

Params = tuple[float, float, float]
"""A, B, C_mid."""
PHI, EVALS = 0.6, 75
RUN_SD = run_sd(MARGIN)
"""Run-to-run sd of A: two runs of one recipe within the paper's 0.02 of each other 90% of the time."""


def table1(name: str) -> Params:
    C_mid, B, A = TABLE1[name]
    return A, B, C_mid


EIGHT_B = table1("scalerl-8b")


@dataclass
class Case:
    name: str
    a: Params
    b: Params
    budget: float
    """Compute of both runs' last evaluation."""
    run_to_run: float = RUN_SD
    """sd of each run's A around its recipe's."""
    margins: tuple[float, ...] = (MARGIN,)
    runs: int = 1
    """Repeated runs per side, pooled into one curve (`megatron-rl fit a=r1.jsonl a=r2.jsonl ...`)."""


CASES = (
    Case("(a) same curve, evaluation noise only", EIGHT_B, EIGHT_B, 25_000.0, 0.0, (0.0, MARGIN)),
    Case("(a) same recipe, A varies run to run", EIGHT_B, EIGHT_B, 25_000.0, RUN_SD, (0.0, MARGIN)),
    Case("(a) same recipe, 2 runs pooled per side", EIGHT_B, EIGHT_B, 25_000.0, RUN_SD, (0.0, MARGIN), runs=2),
    Case("(a) same recipe, 3 runs pooled per side", EIGHT_B, EIGHT_B, 25_000.0, RUN_SD, (0.0, MARGIN), runs=3),
    Case("(b) crossover inside the data: 8B vs MoE", EIGHT_B, table1("moe-17bx16"), 40_000.0),
    Case("(b) crossover inside the data: batch 512 vs 2048", table1("batch-512"), table1("batch-2048"), 50_000.0),
    Case("(c) crossover beyond the data (31,857)", SMALL, LARGE, 20_000.0),
    Case("(d) one curve ahead everywhere: A 0.61 vs 0.66", EIGHT_B, (0.66, *EIGHT_B[1:]), 25_000.0),
    Case("(e) A differs by 0.01", EIGHT_B, (0.62, *EIGHT_B[1:]), 25_000.0),
    Case("(e) A differs by 0.03", EIGHT_B, (0.64, *EIGHT_B[1:]), 25_000.0),
    Case("(e) A differs by 0.03, 2 runs pooled per side", EIGHT_B, (0.64, *EIGHT_B[1:]), 25_000.0, runs=2),
)
TARGETS = (1.0, 4.0)
"""Targets in units of the budget: the last evaluation, and an extrapolation to 4x."""


def _true_gap(case: Case) -> Callable[[float], float]:
    """log C -> R_a - R_b of the recipes' curves."""
    return lambda lc: true_R(case.a, math.exp(lc)) - true_R(case.b, math.exp(lc))


def true_last_crossing(case: Case, start: float, target: float) -> float | None:
    """The last compute in [start, target] where the recipes' curves change order (root finding), or None."""
    gap = _true_gap(case)
    grid = np.linspace(math.log(start), math.log(target), 4001)
    values = np.array([gap(x) for x in grid])
    change = np.flatnonzero(np.sign(values[1:]) * np.sign(values[:-1]) < 0)
    if change.size == 0:
        return None
    k = int(change[-1])
    return math.exp(brentq(gap, grid[k], grid[k + 1]))


def judge(decision: Decision, case: Case) -> str:
    """right / wrong / undecided against the recipes' curves (module docstring)."""
    if decision.leader is None:
        return "undecided"
    true = true_R(case.a, decision.target) - true_R(case.b, decision.target)
    if true == 0 or (true > 0) != (decision.leader == decision.a):
        return "wrong"
    if decision.verdict == "winner":
        return "right"
    assert decision.crossover_interval is not None
    truth = true_last_crossing(case, decision.start, decision.target)
    lo, hi = decision.crossover_interval
    return "right" if truth is not None and lo <= truth <= hi else "wrong"


def _run_of(label: str, params: Params, seed: int, case: Case, boot: int):
    """One side of a pair: `case.runs` runs of the recipe `params`, each with its own A and noise, fitted as one."""
    parts = []
    for j in range(case.runs):
        run_seed = seed if case.runs == 1 else 10 * seed + j
        rng = np.random.default_rng([run_seed, 7])
        A = params[0] + rng.normal(0.0, case.run_to_run) if case.run_to_run else params[0]
        c, R = synthetic_curve(
            A, *params[1:], noise=NOISE, seed=run_seed, points=EVALS, max_compute=case.budget, phi=PHI
        )
        parts.append(Curve(label, c, R, f"{label}-{run_seed}"))
    return fit_run(pool_runs(parts), n_boot=boot, seed=seed)


def evaluate_verdicts(case: Case, seeds: int, boot: int) -> list[dict[str, object]]:
    counts: dict[tuple[float, float], dict[str, int]] = {}
    fit_s, decide_s = 0.0, 0.0
    for seed in tqdm(range(seeds), desc=case.name[:40], leave=False, disable=None):
        started = time.perf_counter()
        a = _run_of("a", case.a, 2 * seed, case, boot)
        b = _run_of("b", case.b, 2 * seed + 1, case, boot)
        fit_s += time.perf_counter() - started
        started = time.perf_counter()
        for margin in case.margins:
            for factor in TARGETS:
                d = decide_pair(a, b, factor * case.budget, confidence=0.9, margin=margin)
                tally = counts.setdefault((margin, factor), {})
                for key in (d.verdict, f"call {judge(d, case)}"):
                    tally[key] = tally.get(key, 0) + 1
        decide_s += time.perf_counter() - started
    rows = []
    for (margin, factor), tally in counts.items():
        share = {k: tally.get(k, 0) / seeds for k in ("winner", "undecided", "crossover")}
        share.update({k: tally.get(f"call {k}", 0) / seeds for k in ("right", "wrong")})
        rows.append({"case": case.name, "margin": margin, "target": factor * case.budget, **share})
    calls = seeds * len(case.margins) * len(TARGETS)
    print(
        f"{case.name}: {fit_s / (2 * seeds):.2f} s per fit and bootstrap, {1e3 * decide_s / calls:.0f} ms per decision"
    )
    return rows


def verdicts(seeds: int, boot: int, only: str | None = None) -> list[dict[str, object]]:
    cases = [case for case in CASES if only is None or only in case.name]
    if not cases:
        raise SystemExit(f"--only {only!r} matches no case of {[case.name for case in CASES]}")
    rows = [row for case in cases for row in evaluate_verdicts(case, seeds, boot)]
    head = ["case", "margin", "target", "winner", "undecided", "crossover", "right", "wrong"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [str(r["case"]), f"{r['margin']:g}", f"{r['target']:,.0f}"]
        cells += [f"{r[k]:.0%}" for k in head[3:]]
        print("| " + " | ".join(cells) + " |")
    return rows


def coverage(seeds: int, boot: int) -> dict[str, dict[str, float]]:
    print(f"true crossover {true_crossover():,.0f}")
    rows = {phi: evaluate(phi, seeds, boot) for phi in PHIS}
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
    return {str(k): v for k, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("verdicts", "coverage"), default="verdicts")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--boot", type=int, default=200)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", default=None, metavar="TEXT", help="verdicts: only the cases whose name has TEXT")
    args = parser.parse_args()
    started = time.perf_counter()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.seeds} seeds, "
          f"{args.boot} refits")  # fmt: skip
    out = verdicts(args.seeds, args.boot, args.only) if args.part == "verdicts" else coverage(args.seeds, args.boot)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
