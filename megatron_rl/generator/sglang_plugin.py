"""megatron_rl's SGLang plugin: what an engine whose weights are updated in flight needs inside SGLang's own
processes. Declared as an entry point of the group `sglang.srt.plugins` (pyproject.toml), which SGLang loads in
every server process (the scheduler that loads weights included), on GPU nodes and CPU alike.

- Llama-4's loader (sglang/srt/models/mllama4.py) warns at the end of every `load_weights` call with every
  parameter that call did not carry. A weight update loads one bucket per call, so each pushed bucket logged the
  ~400 names it did not hold: ~10 MB of log per engine rank per push. The first warning (the checkpoint load,
  where a missing weight is a real problem) passes; the later ones are dropped and counted.
- SGLang's tensor dumper (sglang/srt/debug_utils/dumper.py, imported by every scheduler through its model runner)
  imports megatron-core at import time when it is installed, for a debugging aid that compares dumps with a
  Megatron run (`_MegatronPlugin`). Installed beside the trainer, megatron-core (and with it Transformer Engine
  where present) was imported into every scheduler process: 1.1 s of CPU on the engine's start-up path and
  26 MB of memory per scheduler, measured on CPU. While that one module executes, megatron is reported absent,
  so the dumper's Megatron plugin stays off (`_available = False`, its own fallback); nothing else is touched,
  and a megatron import anywhere else in the process works as before.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from typing import Any

DUMPER = "sglang.srt.debug_utils.dumper"

UNLOADED_WEIGHTS = "Some weights are not initialized from checkpoints"


class RepeatedUnloadedWeights(logging.Filter):
    """Passes the first "weights not initialized" warning of a process, drops the repeats (counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(UNLOADED_WEIGHTS):
            return True
        self.seen += 1
        return self.seen == 1


class _DumperLoader(importlib.abc.Loader):
    """The dumper's own loader, with megatron hidden while its module body runs."""

    def __init__(self, loader: Any, guard: DumperWithoutMegatron) -> None:
        self.loader, self.guard = loader, guard

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the wrapped loader's
        return getattr(self.loader, name)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.guard.active.on = True
        try:
            self.loader.exec_module(module)
        finally:
            self.guard.active.on = False


class DumperWithoutMegatron(importlib.abc.MetaPathFinder):
    """A `sys.meta_path` finder: wraps the dumper's loader, and answers "no such module" for megatron while (and
    only while) the dumper's module body runs in this thread and megatron is not imported yet."""

    def __init__(self) -> None:
        self.active = threading.local()

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name == DUMPER:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _DumperLoader(spec.loader, self)
                    return spec
            return None
        if getattr(self.active, "on", False) and name.split(".")[0] == "megatron" and name not in sys.modules:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from SGLang's dumper)", name=name)
        return None


def register() -> None:
    """SGLang calls this once per process (`sglang.srt.plugins.load_plugins`)."""
    if DUMPER not in sys.modules and not any(isinstance(f, DumperWithoutMegatron) for f in sys.meta_path):
        sys.meta_path.insert(0, DumperWithoutMegatron())
    logger = logging.getLogger("sglang.srt.models.mllama4")
    if not any(isinstance(f, RepeatedUnloadedWeights) for f in logger.filters):
        logger.addFilter(RepeatedUnloadedWeights())
