"""The Megatron-Core trainer (docs/recipe.md §2-3): model building, fp32 log-probs, the RL train step, checkpoints.

Heavy imports (torch, megatron.core) happen inside these modules; importing the package costs nothing but
installing `MegatronImports`, which must precede megatron-core's first import in the process to take effect.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

TIMERS = "megatron.core.timers"
JIT = "megatron.core.jit"
ROUTER = "megatron.core.transformer.moe.router"


def quiet_megatron() -> None:
    """megatron-core warns at import and construction about optional GPU packages (TE, Apex) and
    deprecations; on a run's console (one line per step) or a printed plan those lines hide the output.
    Errors still surface."""
    import logging
    import warnings

    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _eager_on_cpu() -> contextlib.AbstractContextManager[bool]:
    from megatron_rl.trainer import cpu_compat

    return cpu_compat.eager_compile()


class _Loader(importlib.abc.Loader):
    """A module's own loader, its body run inside `MegatronImports`' context for it."""

    def __init__(self, loader: Any, around: Callable[[], contextlib.AbstractContextManager[Any]]):
        self.loader, self.around = loader, around

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the wrapped loader's
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with self.around():
            self.loader.exec_module(module)


class MegatronImports(importlib.abc.MetaPathFinder):
    """A `sys.meta_path` finder that adjusts three megatron-core modules as they are first imported:

    - `megatron.core.timers` imports wandb at import time, for a timer writer the trainer never passes (it logs
      through the driver's metrics): 21 MB and 0.4 CPU-s per trainer rank, measured on CPU. wandb is reported
      absent while (and only while) that module's body runs, so its own fallback (`wandb = None`) applies; a
      wandb import anywhere else in the process works as before. GPU and CPU.
    - `megatron.core.jit` sets megatron's `jit_fuser` to `torch.compile`, and `megatron.core.transformer.moe.router`
      decorates its inference router's top-k with `torch.compile`: decorating imports torch's inductor (63 MB per
      trainer rank on CPU) whether or not a decorated function is ever called. On a host without CUDA their
      bodies run under `cpu_compat.eager_compile()` (eager kernels, the same arithmetic); on GPU nodes nothing
      changes.
    """

    def __init__(self) -> None:
        self.active = threading.local()
        self.around: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
            TIMERS: lambda: self.hiding("wandb"),
            JIT: _eager_on_cpu,
            ROUTER: _eager_on_cpu,
        }

    @contextlib.contextmanager
    def hiding(self, package: str) -> Iterator[None]:
        self.active.hidden = package
        try:
            yield
        finally:
            self.active.hidden = None

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        hidden = getattr(self.active, "hidden", None)
        if hidden is not None and name.split(".")[0] == hidden and name not in sys.modules:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from megatron-core)", name=name)
        if name not in self.around:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, self.around[name])
                return spec
        return None


if TIMERS not in sys.modules and not any(isinstance(f, MegatronImports) for f in sys.meta_path):
    sys.meta_path.insert(0, MegatronImports())
