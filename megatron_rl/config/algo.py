"""The algorithm section: loss, aggregation, advantages, filters and the length penalty (docs/recipe.md §2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.errors import fail

LOSS_DEFAULT_EPS: dict[str, tuple[float, float]] = {
    # Paper's working values (docs/recipe.md §2): (eps_low, eps_high) of the PPO-style clip.
    "gspo": (3e-3, 5e-3),
    "dapo": (0.2, 0.28),
    "grpo": (0.2, 0.2),
    "cispo": (0.2, 0.28),  # unused: CISPO truncates at algo.eps_max, and its clip metric counts that truncation
}


@dataclass
class LengthPenaltyConfig:
    """DAPO's overlong reward shaping, used by the `loo-lp` ablation instead of interruption."""

    enabled: bool = False
    max_length: int = 14336
    """L_max: completion length at which the penalty reaches -1 (ours: thinking + answer budget)."""
    cache_length: int = 2048
    """L_cache: width of the soft-penalty ramp before max_length (ours)."""

    def __post_init__(self) -> None:
        if not 0 < self.cache_length <= self.max_length:
            fail("cache_length", f"must be in (0, max_length={self.max_length}], got {self.cache_length}")


@dataclass
class AlgoConfig:
    """The RL objective: loss, ratio clipping, aggregation, advantage normalisation, filters."""

    loss: Literal["cispo", "gspo", "dapo", "grpo"] = "cispo"
    eps_max: float = 5.0
    """CISPO: absolute cap on the importance ratio (paper: 4, 5, 8 behave the same; 5 is ours)."""
    eps_low: float | None = None
    """PPO-clip lower epsilon; null = the loss's paper value (gspo 3e-3, dapo 0.2, grpo 0.2)."""
    eps_high: float | None = None
    """PPO-clip upper epsilon; null = the loss's paper value (gspo 5e-3, dapo 0.28, grpo 0.2)."""
    aggregation: Literal["prompt", "sample", "token"] = "prompt"
    advantage_norm: Literal["batch", "group", "none"] = "batch"
    advantage_eps: float = 1e-6
    """Added to the std in advantage normalisation (ours)."""
    zero_variance_filter: bool = True
    """Drop groups whose G rewards are all equal (no refill)."""
    no_positive_resampling: float | None = 0.9
    """Pass-rate threshold at which a prompt leaves all later epochs; null = off."""
    length_penalty: LengthPenaltyConfig = field(default_factory=LengthPenaltyConfig)
    truncated: Literal["exclude", "keep"] = "exclude"
    """Completions that hit the answer budget: exclude = left out of the effective batch and of their group's
    advantages (the paper's appendix: the effective batch after excluding truncated samples), counted in
    `train/truncated_excluded`; keep = trained on with their reward (-1 when unanswered)."""
    max_empty_batches: int = 20
    """Stop the run (checkpoint kept) after this many batches in a row in which the zero-variance filter left
    nothing to train on: the policy has collapsed or the data is all too hard or too easy, and the run would
    otherwise sample forever without a step (ours; verl's DAPO stops the same way). 0 = never stop."""

    routing_replay: Literal["none", "measure", "rollout"] = "none"
    """MoE only (docs/recipe.md §9). rollout: the experts the generator chose for every token come back with the
    completion and the trainer's forward and backward route by them (megatron-core's router replay; "R3");
    measure: they come back and the trainer's own routing is compared with them (train/routing_agreement)
    without replaying; none: no routing records."""
    tis_cap: float | None = None
    """Token-level truncated importance sampling for the generator/trainer mismatch: each token's policy
    gradient is taken on the trainer's own distribution (ratio to its detached log-prob) and weighted by
    min(pi_trainer / pi_generator, tis_cap), detached. null = off (the loss's ratio is to the generator, as
    CISPO's truncated weight already is)."""
    mismatch_mask: float | None = None
    """Sequence-level masking: a completion whose geometric-mean ratio pi_trainer / pi_generator over its loss
    tokens leaves [1 / mismatch_mask, mismatch_mask] is left out of the loss (counted in train/mismatch_masked).
    null = off."""

    def __post_init__(self) -> None:
        if self.tis_cap is not None and self.tis_cap <= 0:
            fail("tis_cap", f"must be > 0 or null, got {self.tis_cap}")
        if self.mismatch_mask is not None and self.mismatch_mask <= 1:
            fail("mismatch_mask", f"must be > 1 (bounds the geometric-mean ratio) or null, got {self.mismatch_mask}")
        if self.max_empty_batches < 0:
            fail("max_empty_batches", f"must be >= 0, got {self.max_empty_batches}")
        low, high = LOSS_DEFAULT_EPS[self.loss]
        if self.eps_low is None:
            self.eps_low = low
        if self.eps_high is None:
            self.eps_high = high
        if self.eps_max <= 1.0:
            fail("eps_max", f"must be > 1 (it caps the ratio rho), got {self.eps_max}")
        if not 0 <= self.eps_low < 1:
            fail("eps_low", f"must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            fail("eps_high", f"must be >= 0, got {self.eps_high}")
        if self.no_positive_resampling is not None and not 0 < self.no_positive_resampling <= 1:
            fail("no_positive_resampling", f"must be in (0, 1] or null, got {self.no_positive_resampling}")
