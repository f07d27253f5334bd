"""What the training run's driver holds for its live fit (orchestration/evaluations.py, at every validation)."""

from __future__ import annotations

import json
import subprocess
import sys

LIVE_FIT_IMPORTS = """
import json, sys
from megatron_rl.scaling import live_prediction
from megatron_rl.scaling.synthetic import table1_curve
compute, R = table1_curve("scalerl-8b", noise=0.005, seed=5)
out = live_prediction([{"device_hours": c, "val/pass_rate": r} for c, r in zip(compute, R)], fit_start=1500, n_boot=50)
print(json.dumps({"A": out["scaling/A"], "scipy": sorted(m for m in sys.modules if m.split(".")[0] == "scipy")}))
"""


def test_the_live_fit_imports_no_scipy() -> None:
    """The training run's driver fits at every validation: scipy.special, .optimize and .signal would hold ~70 MiB
    there for the rest of the run."""
    result = subprocess.run([sys.executable, "-c", LIVE_FIT_IMPORTS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["scipy"] == [] and abs(got["A"] - 0.61) < 0.01, got
