"""Which groups and prompts are trained on (docs/recipe.md §2).

- Zero-variance filter: a group whose G rewards are all equal has all-zero advantages and only dilutes
  the batch; it is dropped (no refill) and counted by the caller.
- No-positive resampling: a prompt whose pass rate reaches the threshold (0.9) leaves all later epochs.
  The tracked pass rate is that of the prompt's most recent group (ours). The state is plain data so a
  checkpoint saves and restores it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """The zero-variance filter's test of one group: True when its rewards are not all equal (plain floats:
    the driver runs it on every finished group and holds no torch)."""
    return len(rewards) > 0 and max(rewards) != min(rewards)


@dataclass
class NoPositiveResampling:
    """Tracks each prompt's latest pass rate and retires prompts that reached `threshold`."""

    threshold: float | None = 0.9
    """null disables the filter (every prompt stays)."""
    pass_rates: dict[str, float] = field(default_factory=dict)
    retired: set[str] = field(default_factory=set)

    def update(self, prompt_id: str, passed: Iterable[bool]) -> None:
        """Record a finished group of `prompt_id` (one bool per completion: did it pass?)."""
        passed = list(passed)
        if not passed:
            return
        rate = sum(passed) / len(passed)
        self.pass_rates[prompt_id] = rate
        if self.threshold is not None and rate >= self.threshold:
            self.retired.add(prompt_id)

    def is_active(self, prompt_id: str) -> bool:
        return prompt_id not in self.retired

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "pass_rates": dict(self.pass_rates), "retired": sorted(self.retired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.threshold = state["threshold"]
        self.pass_rates = {str(k): float(v) for k, v in state["pass_rates"].items()}
        self.retired = set(state["retired"])
