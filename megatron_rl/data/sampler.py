"""The curriculum sampler: which prompt is generated next.

Datasets are mixed by their configured weights; within a dataset prompts go in epochs, each epoch a
fresh seeded permutation. Prompts retired by no-positive resampling (algo/filters.py) are skipped in all
later epochs. The whole state (positions, epochs, the random generator, the retired set and pass-rate
history) is plain data for checkpoints, so a resumed run draws exactly the prompts the uninterrupted
run would have drawn. Prompts drawn but not trained on yet (their groups generating or buffered when the
checkpoint was taken) are part of that state: the caller reports each finished one (`done`), and a
resumed run draws the others again, first, before continuing where the epoch was.
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
        self.outstanding: list[tuple[str, int]] = []
        """(source, index) of the prompts drawn and not reported `done`, in the order drawn."""
        self.replay: list[tuple[str, int]] = []
        """Outstanding prompts of the checkpoint this sampler was restored from: drawn again first."""
        self._orders: dict[str, tuple[tuple[str, int], list[int]]] = {}

    def _order(self, source: str) -> list[int]:
        """The source's order in its current epoch: a function of (seed, source, epoch), so a restored sampler
        draws the same; computed once per epoch (a shuffle of the whole source per prompt cost the driver)."""
        key = (source, self.epoch[source])
        if self._orders.get(source, (None, None))[0] != key:
            order = list(range(len(self.train[source])))
            random.Random(f"{self.seed}:{source}:{self.epoch[source]}").shuffle(order)
            self._orders[source] = (key, order)
        return self._orders[source][1]

    def _next_from(self, source: str) -> int:
        prompts = self.train[source]
        order = self._order(source)
        for _ in range(2 * len(prompts) + 1):  # at most one full pass over the remaining and the next epoch
            if self.position[source] >= len(prompts):
                self.epoch[source] += 1
                self.position[source] = 0
                order = self._order(source)
            index = order[self.position[source]]
            self.position[source] += 1
            if self.no_positive.is_active(prompts[index].id):
                return index
            self.retired_skips += 1
        raise RuntimeError(
            f"every prompt of {source} is retired by no-positive resampling (threshold "
            f"{self.no_positive.threshold}); lower algo.no_positive_resampling or add data"
        )

    def next_prompt(self) -> Prompt:
        if self.replay:
            source, index = self.replay.pop(0)
        else:
            source = self.rng.choices(self.sources, weights=self.weights)[0]
            index = self._next_from(source)
        self.outstanding.append((source, index))
        return self.train[source][index]

    def done(self, prompt: Prompt) -> None:
        """`prompt` (as `next_prompt` returned it) was trained on, filtered or skipped: no longer outstanding."""
        for i, (source, index) in enumerate(self.outstanding):
            if self.train[source][index] is prompt:
                del self.outstanding[i]
                return

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.getstate(),
            "epoch": dict(self.epoch),
            "position": dict(self.position),
            "retired_skips": self.retired_skips,
            "no_positive": self.no_positive.state_dict(),
            "outstanding": [[source, index] for source, index in self.outstanding + self.replay],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))  # JSON turns the tuple into a list
        self.epoch = dict(state["epoch"])
        self.position = dict(state["position"])
        self.retired_skips = state["retired_skips"]
        self.no_positive.load_state_dict(state["no_positive"])
        self.outstanding = []
        self.replay = []
        for source, index in state.get("outstanding", []):
            if source not in self.train or not 0 <= index < len(self.train[source]):
                raise ValueError(
                    f"sampler state: outstanding prompt {source}[{index}] is not in the training data "
                    "(the datasets changed since the checkpoint)"
                )
            self.replay.append((source, int(index)))
