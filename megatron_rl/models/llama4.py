"""Llama-4 (text): `Llama4ForCausalLM` <-> canonical megatron names; Scout's multimodal checkpoint imports.

Attention as Llama (no biases); the L2 QK-norm has no weights. The feed-forward of an MoE layer:

    decoder.layers.{i}.mlp.router.weight                       model.layers.{i}.feed_forward.router.weight
    ...mlp.experts.local_experts.{e}.linear_fc1.weight         ...feed_forward.experts.gate_up_proj[e].T
    ...mlp.experts.local_experts.{e}.linear_fc2.weight         ...feed_forward.experts.down_proj[e].T
    ...mlp.shared_experts.linear_fc1.weight = [gate; up]       ...feed_forward.shared_expert.{gate,up}_proj.weight
    ...mlp.shared_experts.linear_fc2.weight                    ...feed_forward.shared_expert.down_proj.weight

HF stores the routed experts fused per layer, `gate_up_proj` [experts, hidden, 2 x ffn] (gate columns first)
and `down_proj` [experts, ffn, hidden], i.e. transposed relative to a linear layer's weight. Importing reads
one expert's slice at a time; exporting assembles the stack from the per-expert megatron tensors
(`Stacked`). A weight push sends the experts one by one instead (`engine_to_hf`), as SGLang's loader accepts.
Dense layers (`interleave_moe_layer_step` > 1, Maverick) use `feed_forward.{gate,up,down}_proj`.

Chunked local attention on RoPE layers (`attention_chunk_size`) and attention-temperature tuning on NoPE
layers (`attn_temperature_tuning`, `floor_scale`, `attn_scale`) are read into the model config and applied by
the trainer's attention (trainer/attention.py). Top-k > 1 routing differs (megatron renormalises sigmoid
scores), so only top-1 (Scout, Maverick) is accepted.

Scout's Hub checkpoint is `Llama4ForConditionalGeneration`: its text tensors carry a `language_model.`
prefix (read transparently), its vision tower and projector are not imported (listed, not an error), and
its config.json nests the text model under `text_config`.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from megatron_rl.config import ModelConfig
from megatron_rl.models import hf_configs, layers
from megatron_rl.models.layers import FromHF, HFTensors, Reader, Stacked

if TYPE_CHECKING:
    from torch import Tensor

MODEL_TYPES = ("llama4_text", "llama4")
MULTIMODAL_PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_model.", "multi_modal_projector.")
_EXPERT = "mlp.experts.local_experts."


def check(cfg: ModelConfig) -> None:
    wrong = []
    if not cfg.is_moe:
        wrong.append("moe.num_experts (Llama-4 layers are MoE)")
    elif cfg.moe.shared_expert_ffn_hidden_size != (cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size):
        wrong.append("moe.shared_expert_ffn_hidden_size (Llama-4's shared expert has the routed experts' size)")
    if cfg.is_moe and cfg.moe.router_score_function != "sigmoid":
        wrong.append("moe.router_score_function (Llama-4 routes with a sigmoid)")
    if cfg.is_moe and not cfg.moe.apply_probs_on_input:
        wrong.append("moe.apply_probs_on_input (Llama-4 weights the expert input)")
    if cfg.is_moe and cfg.moe.router_topk != 1:
        wrong.append("moe.router_topk (only top-1: megatron renormalises top-k sigmoid scores, HF does not)")
    if cfg.qk_layernorm:
        wrong.append("qk_layernorm (Llama-4's QK-norm is the weightless qk_l2_norm)")
    if wrong:
        raise ValueError(f"model.family=llama4: not part of a Llama-4 model: {', '.join(wrong)}")


def to_hf(name: str, tensor: Tensor, cfg: ModelConfig) -> HFTensors:
    def feed_forward(rest: str, prefix: str, tensor: Tensor) -> HFTensors | None:
        ff = prefix + "feed_forward."
        if rest == "mlp.router.weight":
            return [(ff + "router.weight", tensor)]
        if rest.startswith(_EXPERT):
            expert, leaf = rest.removeprefix(_EXPERT).split(".", 1)
            fused = {"linear_fc1.weight": "gate_up_proj", "linear_fc2.weight": "down_proj"}.get(leaf)
            return None if fused is None else [(ff + "experts." + fused, Stacked(int(expert), experts, tensor.T))]
        if rest.startswith("mlp.shared_experts."):
            return layers.mlp_to_hf(rest.removeprefix("mlp.shared_experts."), tensor, ff + "shared_expert.")
        if rest.startswith("mlp."):
            return layers.mlp_to_hf(rest.removeprefix("mlp."), tensor, ff)
        return None

    experts = cfg.moe.num_experts or 0
    return layers.decoder_to_hf(name, tensor, cfg, feed_forward)


def engine_to_hf(name: str, tensor: Tensor, cfg: ModelConfig) -> HFTensors:
    """The weight-update names SGLang's Llama-4 loader takes: the routed experts one by one, as linear weights
    (`feed_forward.experts.{e}.{gate,up,down}_proj.weight`, matched by its FusedMoE expert mapping), so that a
    push never assembles a layer's fused stack (Scout: 4 GB per layer, twice while stacking); else `to_hf`."""
    split = layers.split_layer_name(name)
    if split is not None and split[1].startswith(_EXPERT):
        layer, rest = split
        expert, leaf = rest.removeprefix(_EXPERT).split(".", 1)
        mapped = layers.mlp_to_hf(leaf, tensor, f"model.layers.{layer}.feed_forward.experts.{expert}.")
        if mapped is not None:
            return mapped
    return to_hf(name, tensor, cfg)


def _expert_slice(hf_name: str, expert: int, reader: Reader) -> Tensor:
    return reader.get_index(hf_name, expert).T.contiguous()


def feed_forward_from_hf(cfg: ModelConfig, layer: int) -> Iterator[FromHF]:
    hf, mg = f"model.layers.{layer}.feed_forward.", f"decoder.layers.{layer}.mlp."
    if not layers.is_moe_layer(cfg, layer):
        yield from layers.mlp_from_hf(mg, hf)
        return
    yield layers.copy(mg + "router.weight", hf + "router.weight")
    for expert in range(cfg.moe.num_experts or 0):
        for leaf, fused in (("linear_fc1.weight", "gate_up_proj"), ("linear_fc2.weight", "down_proj")):
            name, source = f"{mg}experts.local_experts.{expert}.{leaf}", hf + "experts." + fused
            yield FromHF(name, (source,), partial(_expert_slice, source, expert))
    yield from layers.mlp_from_hf(mg + "shared_experts.", hf + "shared_expert.")


def from_hf(cfg: ModelConfig) -> Iterator[FromHF]:
    return layers.model_from_hf(cfg, lambda layer: feed_forward_from_hf(cfg, layer))


def checkpoint_prefix(names: set[str]) -> str:
    """`language_model.` for Scout's multimodal checkpoint, "" for a text-only one."""
    multimodal = MULTIMODAL_PREFIX + "model.embed_tokens.weight" in names
    return MULTIMODAL_PREFIX if multimodal and "model.embed_tokens.weight" not in names else ""


def skipped(hf_name: str) -> bool:
    """HF tensors that are deliberately not imported: the vision tower and its projector."""
    return hf_name.startswith(SKIPPED_PREFIXES)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The text model's config.json (Scout's top-level config nests it under `text_config`)."""
    if hf.get("model_type") == "llama4":
        text = dict(hf["text_config"])
        text.update(model_type="llama4_text", architectures=["Llama4ForCausalLM"])
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
        return text
    return hf


def _no_rope_layers(cfg: ModelConfig) -> list[int]:
    """HF's per-layer flag: 1 = the layer uses RoPE."""
    every = cfg.no_rope_freq
    return [int(not every or (i + 1) % every != 0) for i in range(cfg.num_layers)]


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "model_type": "llama4_text",
        "architectures": ["Llama4ForCausalLM"],
        **hf_configs.common_hf(cfg),
        "intermediate_size": cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size,
        "intermediate_size_mlp": cfg.ffn_hidden_size,
        "num_local_experts": cfg.moe.num_experts,
        "num_experts_per_tok": cfg.moe.router_topk,
        "interleave_moe_layer_step": cfg.moe.layer_freq,
        "moe_layers": [i for i in range(cfg.num_layers) if layers.is_moe_layer(cfg, i)],
        "use_qk_norm": cfg.qk_l2_norm,
        "no_rope_layers": _no_rope_layers(cfg),
        "no_rope_layer_interval": cfg.no_rope_freq or cfg.num_layers + 1,
        "router_aux_loss_coef": cfg.moe.aux_loss_coeff,
        # transformers builds the chunked mask whenever a layer uses RoPE: "no chunking" is written as a chunk
        # as long as the longest sequence the model takes.
        "attention_chunk_size": cfg.attention_chunk_size or cfg.max_position_embeddings,
        "attn_temperature_tuning": cfg.attn_temperature_tuning,
        "floor_scale": cfg.floor_scale,
        "attn_scale": cfg.attn_scale,
    }


def _attention_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Chunked attention and temperature tuning, with transformers' defaults for missing keys (8192, on,
    8192, 0.1). Scout writes `attn_temperature_tuning: 4`: any true value turns it on, as in transformers.
    A chunk at least as long as max_position_embeddings never cuts: it reads as no chunking."""
    chunk = hf.get("attention_chunk_size", 8192)
    if chunk is not None and chunk >= hf.get("max_position_embeddings", chunk + 1):
        chunk = None
    return {
        "attention_chunk_size": chunk,
        "attn_temperature_tuning": bool(hf.get("attn_temperature_tuning", True)),
        "floor_scale": int(hf.get("floor_scale", 8192)),
        "attn_scale": float(hf.get("attn_scale", 0.1)),
    }


def model_config(hf: dict[str, Any], name: str) -> ModelConfig:
    hf = text_config(hf)
    hf_configs.unsupported(hf, "llama4", attention_bias=False, hidden_act="silu", num_experts_per_tok=1)
    num_layers = hf["num_hidden_layers"]
    interval = hf.get("no_rope_layer_interval", 4)
    # As transformers' Llama4TextConfig: an empty or missing list means a NoPE layer every `interval` layers
    # (Scout's config.json has no_rope_layers: []).
    rope_layers = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    no_rope_freq = None if all(rope_layers) else interval
    if rope_layers != [int(not no_rope_freq or (i + 1) % no_rope_freq != 0) for i in range(num_layers)]:
        raise ValueError(f"config.json (llama4): no_rope_layers={rope_layers} is not one NoPE layer every N")
    step = hf.get("interleave_moe_layer_step", 1)
    moe_layers = hf.get("moe_layers")
    if moe_layers is not None and moe_layers != list(range(step - 1, num_layers, step)):
        raise ValueError(f"config.json (llama4): moe_layers={moe_layers} is not every {step}th layer")
    fields = {
        **hf_configs.common_fields(hf),
        "ffn_hidden_size": hf.get("intermediate_size_mlp", hf["intermediate_size"]),
        "qk_l2_norm": bool(hf.get("use_qk_norm", True)),
        "no_rope_freq": no_rope_freq,
        **_attention_fields(hf),
    }
    moe = {
        "num_experts": hf["num_local_experts"],
        "router_topk": hf.get("num_experts_per_tok", 1),
        "ffn_hidden_size": hf["intermediate_size"],
        "shared_expert_ffn_hidden_size": hf["intermediate_size"],
        "layer_freq": step,
        "router_score_function": "sigmoid",
        "apply_probs_on_input": True,
    }
    return hf_configs.build_model_config(name, "llama4", fields, moe)
