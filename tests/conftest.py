"""Shared test setup: one thread per process (2-core CI machine), GPU tests deselected without CUDA."""

import os

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
