"""Fitting the sigmoidal law: recovery of the paper's Table 1 parameters, the paper's procedure, the solver."""

from __future__ import annotations

import subprocess
import sys


def test_the_toolkit_imports_no_torch():
    code = (
        "import sys, megatron_rl.scaling, megatron_rl.scaling.cli, megatron_rl.scaling.plot;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
