"""`megatron-rl fit`, the recipe comparison and the figure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_rl.scaling.synthetic import synthetic_curve, write_metrics_jsonl


def _run(path, name, A, B, C_mid, seed, **header):
    compute, R = synthetic_curve(A, B, C_mid, noise=0.005, seed=seed, max_compute=25000)
    return write_metrics_jsonl(path, compute, R, {"name": name, **header})


def test_the_thin_script_runs_the_same_command(tmp_path):
    path = _run(tmp_path / "a.jsonl", "scripted", 0.61, 1.92, 2542, 1)
    script = Path(__file__).resolve().parents[3] / "tools" / "fit_scaling_curve.py"
    command = [sys.executable, str(script), str(path), "--fit-start", "1500", "--bootstrap", "0"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].startswith("scripted")
