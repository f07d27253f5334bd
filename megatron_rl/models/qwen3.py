"""Qwen3 (dense): `Qwen3ForCausalLM` <-> canonical megatron names (layout in models/layers.py).

Per-head RMSNorm on queries and keys (`self_attn.{q,k}_norm`) maps to megatron's q/k layernorm; tied
embeddings (the small Qwen3 models) have no `lm_head.weight` and no megatron `output_layer.weight`.
Sliding-window attention (`use_sliding_window`, off in every released Qwen3) is not supported.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config import ModelConfig
from megatron_rl.models import hf_configs, llama

MODEL_TYPES = ("qwen3",)


def check(cfg: ModelConfig) -> None:
    if not cfg.qk_layernorm:
        raise ValueError("model.qk_layernorm: Qwen3 normalises queries and keys; set it true")
    wrong = [f for f in ("qk_l2_norm", "is_moe", "no_rope_freq") if getattr(cfg, f)]
    if cfg.rope_scaling_factor is not None:
        wrong.append("rope_scaling_factor")
    if wrong:
        raise ValueError(f"model.family=qwen3: {', '.join(wrong)} is not part of a Qwen3 model")


# Same tensors as Llama; the q/k norms are part of the shared attention mapping (models/layers.py).
to_hf = llama.to_hf
from_hf = llama.from_hf


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        **hf_configs.common_hf(cfg),
        "intermediate_size": cfg.ffn_hidden_size,
        "use_sliding_window": False,
    }


def model_config(hf: dict[str, Any], name: str) -> ModelConfig:
    hf_configs.unsupported(hf, "qwen3", attention_bias=False, use_sliding_window=False, hidden_act="silu")
    fields = {**hf_configs.common_fields(hf), "ffn_hidden_size": hf["intermediate_size"], "qk_layernorm": True}
    return hf_configs.build_model_config(name, "qwen3", fields, None)
