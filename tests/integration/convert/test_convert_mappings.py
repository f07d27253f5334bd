"""HF <-> megatron name/shape mappings without megatron: round trips, layouts, configs and error messages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_rl.convert.hf_files import HFReader
from megatron_rl.models import (
    HFMapper,
    from_hf,
)

# The tiny family variants and their checkpoints, as the unit tests of the mappings build them.
_spec = importlib.util.spec_from_file_location(
    "unit_convert_mappings", Path(__file__).parents[2] / "unit" / "convert" / "test_convert_mappings.py"
)
_unit = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_unit)
FAMILY_MODELS, model_cfg, hf_dirs = _unit.FAMILY_MODELS, _unit.model_cfg, _unit.hf_dirs


@pytest.mark.parametrize("key", ["llama4", "llama4_interleaved"])
def test_llama4_pushes_experts_one_by_one_under_names_sglangs_loader_maps(hf_dirs, key):
    """The weight push's names for Llama-4: each routed expert as linear weights, which transposed and stacked
    are the checkpoint's fused tensors exactly; every expert name is one SGLang's FusedMoE expert mapping
    matches (its Llama-4 loader routes names with `experts.{e}.gate_proj.` and the like through it), no
    fused stack is ever held, and every other tensor keeps its checkpoint name."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    cfg = model_cfg(key)
    reader = HFReader(hf_dirs[key])
    canonical = [(recipe.name, recipe.build(reader)) for recipe in from_hf(cfg)]
    fused = dict(HFMapper(cfg).map_all(canonical))
    mapper = HFMapper(cfg, engine=True)
    engine = {}
    for name, tensor in canonical:
        engine.update(mapper.map(name, tensor))
        assert not mapper._stacks  # nothing waits for a layer's last expert
    mapper.finish()
    experts = {n: t for n, t in engine.items() if ".feed_forward.experts." in n}
    assert engine.keys() - experts.keys() == {n for n in fused if ".feed_forward.experts." not in n}
    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj", ckpt_up_proj_name="up_proj",
        num_experts=cfg.moe.num_experts,
    )  # fmt: skip
    assert all(sum(weight_name in n for _, weight_name, _, _ in mapping) == 1 for n in experts)
    for layer in sorted({int(n.split(".")[2]) for n in experts}):
        prefix = f"model.layers.{layer}.feed_forward.experts."
        each = range(cfg.moe.num_experts)
        gate_up = torch.stack(
            [
                torch.cat([experts[f"{prefix}{e}.gate_proj.weight"], experts[f"{prefix}{e}.up_proj.weight"]]).T
                for e in each
            ]
        )
        down = torch.stack([experts[f"{prefix}{e}.down_proj.weight"].T for e in each])
        assert torch.equal(gate_up, fused[prefix + "gate_up_proj"]) and torch.equal(down, fused[prefix + "down_proj"])
    assert all(torch.equal(engine[n], fused[n]) for n in engine.keys() - experts.keys())
