"""Qwen3-MoE: `Qwen3MoeForCausalLM` <-> canonical megatron names.

Attention as Qwen3 (QK-norm). An MoE layer's router and experts, one HF tensor per expert:

    decoder.layers.{i}.mlp.router.weight                          model.layers.{i}.mlp.gate.weight
    ...mlp.experts.local_experts.{e}.linear_fc1.weight = [g; u]   ...mlp.experts.{e}.{gate,up}_proj.weight
    ...mlp.experts.local_experts.{e}.linear_fc2.weight            ...mlp.experts.{e}.down_proj.weight

Routing: softmax over the top-k logits (megatron `router_pre_softmax: false`) equals HF's softmax over
all experts renormalised over the top k (`norm_topk_prob: true`, Qwen3-30B-A3B); `router_pre_softmax:
true` is `norm_topk_prob: false`. Dense layers (`decoder_sparse_step` > 1) use `mlp.{gate,up,down}_proj`;
an irregular `mlp_only_layers` list is not supported.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from megatron_rl.config import ModelConfig
from megatron_rl.models import hf_configs, layers
from megatron_rl.models.layers import FromHF, HFTensors

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("qwen3_moe",)
_EXPERT = "mlp.experts.local_experts."


def check(cfg: ModelConfig) -> None:
    if not cfg.is_moe:
        raise ValueError("model.moe.num_experts: qwen3_moe needs routed experts")
    if not cfg.qk_layernorm:
        raise ValueError("model.qk_layernorm: Qwen3-MoE normalises queries and keys; set it true")
    wrong = []
    if cfg.moe.shared_expert_ffn_hidden_size is not None:
        wrong.append("moe.shared_expert_ffn_hidden_size (Qwen3-MoE has no shared expert)")
    if cfg.moe.router_score_function != "softmax":
        wrong.append("moe.router_score_function (Qwen3-MoE routes with a softmax)")
    if cfg.moe.apply_probs_on_input:
        wrong.append("moe.apply_probs_on_input (Qwen3-MoE weights the expert outputs)")
    wrong += [f for f in ("qk_l2_norm", "no_rope_freq", "rope_scaling_factor") if getattr(cfg, f)]
    if wrong:
        raise ValueError(f"model.family=qwen3_moe: not part of a Qwen3-MoE model: {', '.join(wrong)}")


def to_hf(name: str, tensor: Tensor, cfg: ModelConfig) -> HFTensors:
    return layers.decoder_to_hf(name, tensor, cfg, _feed_forward)


def _feed_forward(rest: str, prefix: str, tensor: Tensor) -> HFTensors | None:
    if rest == "mlp.router.weight":
        return [(prefix + "mlp.gate.weight", tensor)]
    if rest.startswith(_EXPERT):
        expert, leaf = rest.removeprefix(_EXPERT).split(".", 1)
        return layers.mlp_to_hf(leaf, tensor, f"{prefix}mlp.experts.{expert}.")
    if rest.startswith("mlp."):
        return layers.mlp_to_hf(rest.removeprefix("mlp."), tensor, prefix + "mlp.")
    return None


def mlp_from_hf(cfg: ModelConfig, layer: int) -> Iterator[FromHF]:
    hf, mg = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
    if not layers.is_moe_layer(cfg, layer):
        yield from layers.mlp_from_hf(mg, hf)
        return
    yield layers.copy(mg + "router.weight", hf + "gate.weight")
    for expert in range(cfg.moe.num_experts or 0):
        yield from layers.mlp_from_hf(f"{mg}experts.local_experts.{expert}.", f"{hf}experts.{expert}.")


def from_hf(cfg: ModelConfig) -> Iterator[FromHF]:
    return layers.model_from_hf(cfg, lambda layer: mlp_from_hf(cfg, layer))


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        **hf_configs.common_hf(cfg),
        "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size,
        "num_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.router_topk,
        "norm_topk_prob": not cfg.moe.router_pre_softmax,
        "decoder_sparse_step": cfg.moe.layer_freq,
        "mlp_only_layers": [],
        "router_aux_loss_coef": cfg.moe.aux_loss_coeff,
        "use_sliding_window": False,
    }


def model_config(hf: dict[str, Any], name: str) -> ModelConfig:
    hf_configs.unsupported(hf, "qwen3_moe", attention_bias=False, use_sliding_window=False, hidden_act="silu")
    if hf.get("mlp_only_layers"):
        raise ValueError(f"config.json (qwen3_moe): mlp_only_layers={hf['mlp_only_layers']} is not supported")
    fields = {**hf_configs.common_fields(hf), "ffn_hidden_size": hf["intermediate_size"], "qk_layernorm": True}
    moe = {
        "num_experts": hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
        "router_topk": hf["num_experts_per_tok"],
        "ffn_hidden_size": hf["moe_intermediate_size"],
        "router_score_function": "softmax",
        "router_pre_softmax": not hf.get("norm_topk_prob", False),
        "layer_freq": hf.get("decoder_sparse_step", 1),
    }
    return hf_configs.build_model_config(name, "qwen3_moe", fields, moe)
