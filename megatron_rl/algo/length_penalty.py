"""DAPO's overlong reward shaping, used by the `loo-lp` ablation instead of interruption (docs/recipe.md §2).

With L_max = max_length and L_cache = cache_length, a completion of length L gets an extra reward

    0                              if L <= L_max - L_cache
    ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max   (a linear ramp from 0 to -1)
    -1                             if L > L_max
"""

from __future__ import annotations


def overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    if cache_length <= 0 or cache_length > max_length:
        raise ValueError(
            f"algo.length_penalty.cache_length: must be in (0, max_length={max_length}], got {cache_length}"
        )
    soft_start = max_length - cache_length
    if length <= soft_start:
        return 0.0
    if length <= max_length:
        return (soft_start - length) / cache_length
    return -1.0
