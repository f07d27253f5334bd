"""The CLI and the driver start without torch, as a fresh interpreter imports them."""

from __future__ import annotations

import subprocess
import sys


def test_the_cli_and_the_driver_start_without_torch() -> None:
    """`megatron-rl train` starts Ray before anything imports torch (seconds of CPU on a laptop): the data and the
    tokenizer load in a thread while Ray's processes start (orchestration/train.py). A top-level torch import in
    the CLI or the driver's modules would put those seconds back in front of Ray."""
    code = (
        "import sys, megatron_rl.cli, megatron_rl.orchestration.train;"
        "from megatron_rl.cli import build_parser; build_parser();"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
