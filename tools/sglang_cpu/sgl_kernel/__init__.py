"""Placeholder for SGLang's `sgl_kernel` on CPU machines (installed by tools/install_sglang.sh).

The PyPI `sgl_kernel` is CUDA-only and the CPU build needs Intel AMX sources; SGLang imports a few of
its names at start-up even on the torch-native CPU path, where none of them is called. Every attribute
here is a function that raises if it is ever called, naming itself, so a code path that does need the
real kernel fails loudly instead of computing something wrong.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.0.0+megatron_rl.cpu_placeholder"


class KernelUnavailable(RuntimeError):
    pass


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise KernelUnavailable(
            f"sgl_kernel.{name} was called, but this machine has megatron_rl's CPU placeholder for "
            "sgl_kernel (no CPU build of SGLang's kernels is installed); use --attention-backend torch_native"
        )

    unavailable.__name__ = name
    return unavailable
