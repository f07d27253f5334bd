"""megatron_rl.trainer.MegatronImports: what megatron-core imports into a trainer rank that the trainer never uses."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch
if sys.argv[1] == "cuda":
    torch.cuda.is_available = lambda: True  # what a GPU node answers; nothing here touches a device
compile_ = torch.compile
import megatron_rl.trainer  # installs the hooks, as every trainer process does before megatron-core
import megatron_rl.trainer  # noqa: F811  (a second import installs nothing more)
from megatron.core import jit, timers
from megatron.core.transformer.moe import router
def f(x):
    return x
print("wandb", timers.wandb is None, "wandb" in sys.modules)
print("jit", jit.jit_fuser(f) is f, jit.jit_fuser is compile_)
print("router wrapped", hasattr(router.InferenceTopKRouter.__dict__["_compiled_topk_routing"].__func__, "__wrapped__"))
print("inductor", "torch._inductor.compiler_bisector" in sys.modules, torch.compile is compile_)
import wandb  # noqa: E402  (outside megatron's timers wandb imports as usual)
print("later", "wandb" in sys.modules)
print("hooks", sum(type(f).__name__ == "MegatronImports" for f in sys.meta_path))
"""


def _probe(mode: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_a_cpu_trainer_imports_neither_wandb_nor_inductor_through_megatron() -> None:
    """megatron's timers imported wandb (21 MB) and its `torch.compile` decorators torch's inductor (63 MB) into every
    trainer rank. On CPU the decorated functions are the functions themselves; torch.compile is restored after."""
    assert _probe("cpu") == [
        "wandb True False",
        "jit True False",
        "router wrapped False",
        "inductor False True",
        "later True",
        "hooks 1",
    ]


def test_a_gpu_trainer_keeps_megatrons_compiled_fusions() -> None:
    lines = _probe("cuda")
    assert lines[0] == "wandb True False"  # wandb is hidden from the timers on GPU nodes too
    assert lines[1] == "jit False True"  # jit_fuser is torch.compile
    assert lines[2] == "router wrapped True"  # torch.compile's wrapper
    assert lines[3] == "inductor True True"
