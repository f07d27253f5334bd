"""The curriculum sampler: which prompt is generated next.

Datasets are mixed by their configured weights; within a dataset prompts go in epochs, each epoch a
fresh seeded permutation. Prompts retired by no-positive resampling (algo/filters.py) are skipped in all
later epochs. The whole state (positions, epochs, the random generator, the retired set and pass-rate
history) is plain data for checkpoints, so a resumed run draws exactly the prompts the uninterrupted
run would have drawn.
"""

from __future__ import annotations

import random
from typing import Any

from megatron_rl.algo.filters import NoPositiveResampling
from megatron_rl.data.datasets import Prompt


class CurriculumSampler:
    def __init__(
        self,
        train: dict[str, list[Prompt]],
        weights: dict[str, float],
        seed: int,
        no_positive: NoPositiveResampling,
    ) -> None:
        if set(train) != set(weights):
            raise ValueError(f"data.datasets: weights given for {sorted(weights)} but datasets are {sorted(train)}")
        self.train = train
        self.sources = sorted(train)
        self.weights = [weights[s] for s in self.sources]
        self.seed = seed
        self.no_positive = no_positive
        self.rng = random.Random(seed)
        self.epoch = {s: 0 for s in self.sources}
        self.position = {s: 0 for s in self.sources}
        self.retired_skips = 0
        """Prompts skipped because they were retired (a metric)."""

    def _order(self, source: str) -> list[int]:
        order = list(range(len(self.train[source])))
        random.Random(f"{self.seed}:{source}:{self.epoch[source]}").shuffle(order)
        return order

    def _next_from(self, source: str) -> Prompt:
        prompts = self.train[source]
        order = self._order(source)
        for _ in range(2 * len(prompts) + 1):  # at most one full pass over the remaining and the next epoch
            if self.position[source] >= len(prompts):
                self.epoch[source] += 1
                self.position[source] = 0
                order = self._order(source)
            prompt = prompts[order[self.position[source]]]
            self.position[source] += 1
            if self.no_positive.is_active(prompt.id):
                return prompt
            self.retired_skips += 1
        raise RuntimeError(
            f"every prompt of {source} is retired by no-positive resampling (threshold "
            f"{self.no_positive.threshold}); lower algo.no_positive_resampling or add data"
        )

    def next_prompt(self) -> Prompt:
        source = self.rng.choices(self.sources, weights=self.weights)[0]
        return self._next_from(source)

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.getstate(),
            "epoch": dict(self.epoch),
            "position": dict(self.position),
            "retired_skips": self.retired_skips,
            "no_positive": self.no_positive.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))  # JSON turns the tuple into a list
        self.epoch = dict(state["epoch"])
        self.position = dict(state["position"])
        self.retired_skips = state["retired_skips"]
        self.no_positive.load_state_dict(state["no_positive"])
