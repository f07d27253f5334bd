"""megatron_rl's SGLang plugin: what an engine whose weights are updated in flight needs inside SGLang's own
processes. Declared as an entry point of the group `sglang.srt.plugins` (pyproject.toml), which SGLang loads in
every server process (the scheduler that loads weights included), on GPU nodes and CPU alike.

- Llama-4's loader (sglang/srt/models/mllama4.py) warns at the end of every `load_weights` call with every
  parameter that call did not carry. A weight update loads one bucket per call, so each pushed bucket logged the
  ~400 names it did not hold: ~10 MB of log per engine rank per push. The first warning (the checkpoint load,
  where a missing weight is a real problem) passes; the later ones are dropped and counted.
"""

from __future__ import annotations

import logging

UNLOADED_WEIGHTS = "Some weights are not initialized from checkpoints"


class RepeatedUnloadedWeights(logging.Filter):
    """Passes the first "weights not initialized" warning of a process, drops the repeats (counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(UNLOADED_WEIGHTS):
            return True
        self.seen += 1
        return self.seen == 1


def register() -> None:
    """SGLang calls this once per process (`sglang.srt.plugins.load_plugins`)."""
    logger = logging.getLogger("sglang.srt.models.mllama4")
    if not any(isinstance(f, RepeatedUnloadedWeights) for f in logger.filters):
        logger.addFilter(RepeatedUnloadedWeights())
