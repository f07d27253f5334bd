"""The GPU smoke tier: tools/gpu_smoke.py on this node's CUDA device, every check passing (or not run for a
component the node lacks, such as Transformer Engine on a bare node).

    pytest -m gpu            # on a GPU node; without CUDA these tests are deselected, and the summary says so
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SMOKE = Path(__file__).resolve().parents[2] / "tools" / "gpu_smoke.py"


@pytest.mark.gpu
@pytest.mark.slow
def test_the_gpu_path_passes_its_smoke_checks(tmp_path):
    done = subprocess.run([sys.executable, str(SMOKE), "--out", str(tmp_path)], capture_output=True, text=True)
    results = json.loads((tmp_path / "results.json").read_text())
    failed = {name: row.get("error") for name, row in results.items() if row["status"] == "FAIL"}
    assert not failed, f"{failed}\n{done.stdout[-4000:]}"
    assert done.returncode == 0, done.stderr[-4000:]
    assert results["environment"]["device"] != "cpu"
    passed = {name for name, row in results.items() if row["status"] == "PASS"}
    assert passed >= {"settings", "logprobs", "push", "loop"}
