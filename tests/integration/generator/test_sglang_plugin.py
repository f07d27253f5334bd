"""megatron_rl's SGLang plugin (generator/sglang_plugin.py), loaded by SGLang in every server process."""

from __future__ import annotations

import logging
import subprocess
import sys

from megatron_rl.generator.sglang_plugin import UNLOADED_WEIGHTS, RepeatedUnloadedWeights

DUMPER_PROBE = """
import sys
from megatron_rl.generator.sglang_plugin import register
if sys.argv[1] == "megatron-first":
    import megatron.core.parallel_state  # noqa: F401
register()
register()  # SGLang may load plugins more than once per process
import sglang.srt.debug_utils.dumper as dumper
print("available", dumper._MegatronPlugin._available, "megatron.core" in sys.modules)
import megatron.core.parallel_state  # noqa: F401, E402  (outside the dumper megatron imports as usual)
print("later", "megatron.core" in sys.modules)
"""


def _probe(mode: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", DUMPER_PROBE, mode], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if line.startswith(("available", "later"))]


def test_sglangs_dumper_does_not_import_megatron_into_the_scheduler() -> None:
    """Every scheduler imports the dumper (through its model runner); with megatron-core installed beside the trainer
    it imported megatron-core (1.1 s of CPU, 26 MB) for a debugging aid. Its Megatron plugin stays off instead."""
    assert _probe("plain") == ["available False False", "later True"]


def test_a_process_that_imported_megatron_keeps_the_dumpers_megatron_plugin() -> None:
    assert _probe("megatron-first") == ["available True True", "later True"]


def test_the_unloaded_weights_warning_passes_once() -> None:
    keep = RepeatedUnloadedWeights()
    records = [logging.LogRecord("m", logging.WARNING, "f", 1, msg, None, None) for msg in (
        UNLOADED_WEIGHTS + ": a, b", "something else", UNLOADED_WEIGHTS + ": c", UNLOADED_WEIGHTS + ": d")]  # fmt: skip
    assert [keep.filter(r) for r in records] == [True, True, False, False]
    assert keep.seen == 3
