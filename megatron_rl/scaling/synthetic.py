"""Synthetic compute-performance curves from the paper's Table 1 (docs/recipe.md §1): tests, benchmarks, docs.

Sampling follows the paper's runs: an evaluation every 100 steps at a constant cost per step, i.e. evenly
spaced in compute, 75 evaluations plus the step-0 one (the 8B run of Figure 1 took 7,400 steps). The
budget is 10 x C_mid by default (ours; the Figure 1 runs span 12x (MoE) to 39x (8B) their C_mid, and a
shorter span is the harder case for A); the math and code curves of the multi-task row come from one run
and share its budget (10 x the math curve's C_mid). R0 is 0.30 (Table 1 does not list it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rl.scaling.fit import Array, sigmoid

TABLE1: dict[str, tuple[float, float, float]] = {
    # run: (C_mid GPU-hours, B, A)
    "scalerl-8b": (2542, 1.92, 0.610),
    "gen-32k": (11272, 1.89, 0.645),
    "moe-17bx16": (4242, 1.65, 0.710),
    "batch-512": (2818, 1.77, 0.605),
    "batch-2048": (10909, 1.70, 0.645),
    "gens-8": (2542, 2.44, 0.585),
    "gens-24": (3054, 2.22, 0.590),
    "gens-32": (2936, 2.07, 0.595),
    "multitask-math": (2896, 2.05, 0.595),
    "multitask-code": (1675, 1.09, 0.615),
}
R0 = 0.30
"""Step-0 pass rate of the synthetic curves."""
SPAN = 10.0
"""Default budget of a synthetic run, in units of its C_mid."""
EVALS = 75
EVAL_EVERY_STEPS = 100


def table1_budget(name: str, span: float = SPAN) -> float:
    """Compute budget of a Table 1 row's synthetic run (the multi-task curves share one run)."""
    run = "multitask-math" if name.startswith("multitask-") else name
    return span * TABLE1[run][0]


def synthetic_curve(
    A: float,
    B: float,
    C_mid: float,
    R0: float = R0,
    noise: float = 0.0075,
    seed: int = 0,
    points: int = EVALS,
    max_compute: float | None = None,
    phi: float = 0.0,
) -> tuple[Array, Array]:
    """The step-0 point (R0, exact) plus `points` evaluations evenly spaced up to `max_compute` (default
    10 x C_mid), each with Gaussian noise of standard deviation `noise`.

    `phi` != 0 makes the noise AR(1) from one evaluation to the next, e_t = phi e_(t-1) + innovation,
    stationary with the same standard deviation `noise`: the validation points of one run are
    autocorrelated (the policy drifts slowly around its expected curve), so they carry less information
    than their number suggests (benchmarks/bench_scaling_fit.py measures the intervals on such curves)."""
    if not -1 < phi < 1:
        raise ValueError(f"phi must be in (-1, 1), got {phi}")
    rng = np.random.default_rng(seed)
    budget = SPAN * C_mid if max_compute is None else max_compute
    compute = budget * np.arange(points + 1) / points
    R = sigmoid(compute, A, B, C_mid, R0)
    if phi == 0:
        R[1:] += rng.normal(0.0, noise, points)
        return compute, R
    shocks = rng.normal(0.0, noise, points)
    e = np.empty(points)
    e[0] = shocks[0]  # stationary start: the first value already has the marginal spread
    for t in range(1, points):
        e[t] = phi * e[t - 1] + math.sqrt(1 - phi**2) * shocks[t]
    R[1:] += e
    return compute, R


def table1_curve(
    name: str, noise: float = 0.0075, seed: int = 0, span: float = SPAN, phi: float = 0.0
) -> tuple[Array, Array]:
    C_mid, B, A = TABLE1[name]
    return synthetic_curve(A, B, C_mid, noise=noise, seed=seed, max_compute=table1_budget(name, span), phi=phi)


def write_metrics_jsonl(
    path: str | Path,
    compute: Array,
    R: Array,
    run: dict[str, Any],
    task_R: dict[str, Array] | None = None,
    train_every_steps: int = 20,
) -> Path:
    """A metrics file as megatron_rl/metrics.py writes it: the `{"run": ...}` header, then step rows with
    `device_hours` and `train/*` keys, and validation rows (every 100 steps) with `val/pass_rate` and
    `val/pass_rate/<task>`. Compute grows linearly with steps between evaluations."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = [json.dumps({"run": run})]
    last_step = (len(compute) - 1) * EVAL_EVERY_STEPS
    for step in range(0, last_step + 1, train_every_steps):
        device_hours = float(np.interp(step / EVAL_EVERY_STEPS, np.arange(len(compute)), compute))
        row: dict[str, Any] = {"step": step, "device_hours": device_hours}
        if step % EVAL_EVERY_STEPS == 0:
            i = step // EVAL_EVERY_STEPS
            row["val/pass_rate"] = float(R[i])
            for task, values in (task_R or {}).items():
                row[f"val/pass_rate/{task}"] = float(values[i])
        row.update({"train/reward": float(rng.uniform(-1, 1)), "train/truncation_rate": 0.01})
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path
