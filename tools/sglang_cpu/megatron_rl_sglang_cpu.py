"""Import guard for torchvision's op registrations on CPU-only torch (imported by megatron_rl_sglang_cpu.pth).

Why: SGLang imports torchvision (its multimodal processors and config modules use
`torchvision.transforms`). The only torchvision on the reachable registries is PyPI's CUDA-linked wheel:
its C++ extension does not load under CPU torch, so its ops (`torchvision::nms`, `roi_align`, ...) are
never registered, and `import torchvision` then dies in `torchvision/__init__.py` at
`_meta_registrations` (fake kernels for those ops): "RuntimeError: operator torchvision::nms does not
exist". The same holds for `_autograd_registrations`.

What: a `sys.meta_path` finder that answers for exactly those two modules, and only when CUDA is absent
and torchvision's ops are not registered, with an empty module, so the rest of torchvision (transforms,
datasets, the pure-Python parts) imports normally. Registering fake/autograd kernels for ops that do not
exist has nothing to do, so skipping them changes no behaviour; calling a torchvision op still fails with
torch's own "operator does not exist" error. With a working torchvision (GPU node, a CPU build) the
finder steps aside and the real modules load. Nothing in torchvision's files is modified.

Cost: one set lookup per import; `import torch` is never triggered by this module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

GUARDED = frozenset({"torchvision._meta_registrations", "torchvision._autograd_registrations"})


def _needs_guard() -> bool:
    torch = sys.modules.get("torch")  # torchvision imports torch before these modules
    if torch is None or torch.cuda.is_available():
        return False
    try:
        torch.ops.torchvision.nms  # noqa: B018 - registered only when torchvision's C++ extension loaded
    except (AttributeError, RuntimeError):
        return True
    return False


class _EmptyModuleLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = (
            "Skipped by megatron_rl_sglang_cpu: torchvision's C++ ops are not registered under this CPU-only "
            "torch, so there are no fake/autograd kernels to register."
        )
        module.SKIPPED_BY_MEGATRON_RL = True


class TorchvisionRegistrationGuard(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in GUARDED or not _needs_guard():
            return None
        return importlib.machinery.ModuleSpec(fullname, _EmptyModuleLoader(), origin="megatron_rl_sglang_cpu")


def install() -> None:
    if not any(isinstance(finder, TorchvisionRegistrationGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionRegistrationGuard())


install()
