"""The Megatron-Core trainer (docs/recipe.md §2-3): model building, fp32 log-probs, the RL train step, checkpoints.

Heavy imports (torch, megatron.core) happen inside these modules; importing the package costs nothing.
"""


def quiet_megatron() -> None:
    """megatron-core warns at import and construction about optional GPU packages (TE, Apex) and
    deprecations; on a run's console (one line per step) or a printed plan those lines hide the output.
    Errors still surface."""
    import logging
    import warnings

    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    logging.getLogger("megatron").setLevel(logging.ERROR)
