"""Config loading, overrides, validation messages, and the no-heavy-imports rule."""

import functools
import subprocess
import sys

import pytest

from megatron_rl.config import (
    load_config,
)


def test_config_module_imports_no_heavy_packages():
    code = (
        "import sys, megatron_rl.config, megatron_rl.cli\n"
        "heavy = [m for m in ('torch', 'megatron', 'sglang', 'ray') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@functools.cache
def _column_parallel_linear(gradient_accumulation_fusion: bool) -> str | None:
    """megatron's ColumnParallelLinear (GPTModel's output layer under every layer spec), built on CPU in a fresh
    process (megatron's parallel state is process-global) as rank 0 of one under the fake backend: None if it
    builds, else its error's last line. Once per setting: it depends on nothing else."""
    script = f"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
config = ModelParallelConfig(gradient_accumulation_fusion={gradient_accumulation_fusion}, use_cpu_initialization=True)
ColumnParallelLinear(8, 16, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    return done.stderr.strip().splitlines()[-1] if done.returncode else None


@pytest.mark.parametrize("model_name", ["llama3_8b", "qwen3_4b", "qwen3_30b_a3b", "llama4_scout_17bx16e"])
def test_the_gradient_accumulation_fusion_resolves_to_what_the_image_can_build(model_name):
    """A GPU node with the image's Transformer Engine and no Apex: null resolves off, and megatron's output layer
    builds with the cluster's setting; resolved as 'TE means on' (the old rule) it does not."""
    from megatron_rl.trainer import model

    run = load_config("scalerl", model_name)
    cluster = model.cluster_performance_settings(run.trainer)
    assert cluster["gradient_accumulation_fusion"] is False and cluster["bias_activation_fusion"] is True
    assert _column_parallel_linear(cluster["gradient_accumulation_fusion"]) is None
    old_rule = model.performance_settings(run.trainer, te=True, apex=True)["gradient_accumulation_fusion"]
    assert "fused_weight_gradient_mlp_cuda" in (_column_parallel_linear(old_rule) or "")
