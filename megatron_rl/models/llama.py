"""Llama 3.x (dense): `LlamaForCausalLM` <-> canonical megatron names (layout in models/layers.py).

Llama-3.1's RoPE frequency scaling (`rope_type: llama3`) maps to `model.rope_scaling_factor` and its
low/high frequency factors; attention and MLP biases (`attention_bias`, `mlp_bias`) are not supported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from megatron_rl.config import ModelConfig
from megatron_rl.models import hf_configs, layers
from megatron_rl.models.layers import FromHF, HFTensors

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("llama",)


def check(cfg: ModelConfig) -> None:
    wrong = [f for f in ("qk_layernorm", "qk_l2_norm", "is_moe") if getattr(cfg, f)]
    if cfg.no_rope_freq:
        wrong.append("no_rope_freq")
    if wrong:
        raise ValueError(f"model.family=llama: {', '.join(wrong)} is not part of a Llama-3 model")


def to_hf(name: str, tensor: Tensor, cfg: ModelConfig) -> HFTensors:
    return layers.decoder_to_hf(name, tensor, cfg, _mlp)


def _mlp(rest: str, prefix: str, tensor: Tensor) -> HFTensors | None:
    return layers.mlp_to_hf(rest.removeprefix("mlp."), tensor, prefix + "mlp.") if rest.startswith("mlp.") else None


def from_hf(cfg: ModelConfig) -> Iterator[FromHF]:
    dense = lambda layer: layers.mlp_from_hf(f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp.")
    return layers.model_from_hf(cfg, dense)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **hf_configs.common_hf(cfg),
        "intermediate_size": cfg.ffn_hidden_size,
        "mlp_bias": False,
    }


def model_config(hf: dict[str, Any], name: str) -> ModelConfig:
    hf_configs.unsupported(hf, "llama", attention_bias=False, mlp_bias=False, hidden_act="silu")
    fields = {**hf_configs.common_fields(hf), "ffn_hidden_size": hf["intermediate_size"]}
    return hf_configs.build_model_config(name, "llama", fields, None)
