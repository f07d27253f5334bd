"""Synthetic compute-performance curves from the paper's Table 1 (SCALERL.md §1), for tests and benchmarks."""

from __future__ import annotations

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
"""Step-0 pass rate used for the synthetic curves (the paper's Table 1 does not list R0)."""


def synthetic_curve(
    A: float,
    B: float,
    C_mid: float,
    R0: float = R0,
    noise: float = 0.0075,
    seed: int = 0,
    points: int = 75,
    span: float = 20.0,
) -> tuple[Array, Array]:
    """`points` evaluations evenly spaced in compute up to `span` x C_mid (an eval every N steps at constant
    cost per step), plus the step-0 point, with Gaussian noise of standard deviation `noise`."""
    rng = np.random.default_rng(seed)
    compute = span * C_mid * np.arange(0, points + 1) / points
    R = np.empty_like(compute)
    R[0] = R0
    R[1:] = sigmoid(compute[1:], A, B, C_mid, R0) + rng.normal(0.0, noise, points)
    return compute, R
