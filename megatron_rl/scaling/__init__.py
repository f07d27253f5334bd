"""The scaling-curve toolkit (SCALERL.md §1): fit, predict and compare sigmoidal compute-performance curves.

numpy/scipy/matplotlib only; see fit.py (the law, the paper's and our fitting procedure, bootstrap),
curves.py (inputs), compare.py, plot.py, live.py and `megatron-rl fit` (cli.py).
"""

from megatron_rl.scaling.fit import Bootstrap, Fit, FitError, bootstrap, extrapolation_check, fit_curve, sigmoid
from megatron_rl.scaling.live import live_prediction

__all__ = [
    "Bootstrap",
    "Fit",
    "FitError",
    "bootstrap",
    "extrapolation_check",
    "fit_curve",
    "live_prediction",
    "sigmoid",
]
