"""The scaling-curve toolkit (docs/recipe.md §1): fit, predict and compare sigmoidal compute-performance curves.

numpy, scipy and matplotlib only (never torch), so it runs anywhere the metrics files are:

    fit.py            the law, the paper's fitting procedure and the fast one (ours)
    bootstrap.py      intervals for A, B, C_mid and for R at any compute (autocorrelated noise, repeated runs)
    extrapolation.py  fit up to a compute cut, predict the rest
    curves.py         inputs: the metrics JSONL megatron_rl writes, CSV exports, run labels
    compare.py        recipes side by side, the paper's shared-A rule, tables per scaling axis
    decision.py       winner / undecided / crossover between runs at a target compute, with run-to-run variation
    plot.py           the figure: points, fits, extrapolations, bands, the efficiency view
    live.py           the predicted asymptote logged at each evaluation of a training run
    synthetic.py      curves from the paper's Table 1 for tests, benchmarks and the docs figure
    cli.py            `megatron-rl fit`
    sweep.py          a grid of runs fitted live, the stopping rule, the sweep's state (sweep_cli.py: `megatron-rl
                      sweep`; launchers.py: local processes or Slurm jobs; sweep_report.py: the comparison at the end)
"""

from megatron_rl.scaling.bootstrap import Bootstrap, bootstrap
from megatron_rl.scaling.extrapolation import Extrapolation, extrapolation_check
from megatron_rl.scaling.fit import Fit, FitError, fit_curve, sigmoid
from megatron_rl.scaling.live import LivePrediction, live_prediction

__all__ = [
    "Bootstrap",
    "Extrapolation",
    "Fit",
    "FitError",
    "LivePrediction",
    "bootstrap",
    "extrapolation_check",
    "fit_curve",
    "live_prediction",
    "sigmoid",
]
