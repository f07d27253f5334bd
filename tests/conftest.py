"""Shared test setup: one thread per process (2-core CI machine), GPU tests deselected without CUDA."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


_DESELECTED_GPU: list = []


def pytest_collection_modifyitems(config, items):
    """Without CUDA, the GPU tier (`-m gpu`) is deselected rather than skipped; the summary says how many."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    _DESELECTED_GPU.extend(gpu)
    items[:] = [item for item in items if not item.get_closest_marker("gpu")]
    config.hook.pytest_deselected(items=gpu)


def pytest_terminal_summary(terminalreporter):
    if _DESELECTED_GPU:
        terminalreporter.write_line(
            f"{len(_DESELECTED_GPU)} GPU test(s) deselected: no CUDA device here (on a GPU node: pytest -m gpu)"
        )


@pytest.fixture
def pushed_every_step():
    """A check over a run's step rows (in step order): every step's weights reached the engines, by that step's push
    or, for a row holding evaluation results (its push may wait one step while the engines evaluate), the next's."""

    def check(steps: list[dict]) -> bool:
        def evaluated(row: dict) -> bool:
            return any(key.startswith(("val/", "downstream/")) for key in row)

        pairs = zip(steps, steps[1:], strict=False)
        held = all(r.get("sync/bytes", 0) > 0 or (evaluated(r) and after["sync/bytes"] > 0) for r, after in pairs)
        return held and steps[-1]["sync/bytes"] > 0

    return check


@pytest.fixture(scope="session")
def trained_policy():
    """The CPU recipe's starting policy: the tiny Llama warmed up on worked solutions (a trained Hugging Face
    checkpoint, not random weights), built once per machine and cached (orchestration/warmstart.py, ~2 min)."""
    from megatron_rl.config import load_config
    from megatron_rl.data.datasets import load_splits
    from megatron_rl.orchestration.warmstart import prepare_policy

    run = load_config("scalerl-cpu", None, [])
    return prepare_policy(run, load_splits(run.data))
