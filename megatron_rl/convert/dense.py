"""Llama-3 and Qwen3 (dense): canonical megatron names <-> Hugging Face names.

    megatron                                        Hugging Face
    embedding.word_embeddings.weight                model.embed_tokens.weight
    decoder.layers.{i}.input_layernorm.weight       model.layers.{i}.input_layernorm.weight
    ...self_attention.linear_qkv.weight             ...self_attn.{q,k,v}_proj.weight  (grouped, see below)
    ...self_attention.q_layernorm.weight (Qwen3)    ...self_attn.q_norm.weight  (k likewise)
    ...self_attention.linear_proj.weight            ...self_attn.o_proj.weight
    ...pre_mlp_layernorm.weight                     ...post_attention_layernorm.weight
    ...mlp.linear_fc1.weight  = [gate; up]          ...mlp.gate_proj.weight, ...mlp.up_proj.weight
    ...mlp.linear_fc2.weight                        ...mlp.down_proj.weight
    decoder.final_layernorm.weight                  model.norm.weight
    output_layer.weight                             lm_head.weight (absent when embeddings are tied)

megatron's fused QKV is grouped by key/value head: for each of the `num_query_groups` groups, its
`heads / groups` query heads, then its key head, then its value head (rows of `head_dim` each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from megatron_rl.config import ModelConfig

Get = Callable[[str], Tensor]


def split_qkv(qkv: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    groups, per_group, dim = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    grouped = qkv.view(groups, per_group + 2, dim, -1)
    q = grouped[:, :per_group].reshape(groups * per_group * dim, -1)
    return q, grouped[:, per_group].reshape(groups * dim, -1), grouped[:, per_group + 1].reshape(groups * dim, -1)


def join_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    groups, per_group, dim = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    hidden = q.shape[-1]
    parts = [q.view(groups, per_group, dim, hidden), k.view(groups, 1, dim, hidden), v.view(groups, 1, dim, hidden)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


ATTENTION = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
MLP = {"mlp.linear_fc2.weight": "mlp.down_proj.weight"}
TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def layer_to_hf(rest: str, tensor: Tensor, prefix: str, cfg: ModelConfig) -> list[tuple[str, Tensor]] | None:
    """Attention, norms and a dense MLP of one layer (`rest` is the name after `decoder.layers.{i}.`)."""
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(tensor, cfg)
        return [
            (f"{prefix}self_attn.q_proj.weight", q),
            (f"{prefix}self_attn.k_proj.weight", k),
            (f"{prefix}self_attn.v_proj.weight", v),
        ]
    if rest in ATTENTION:
        return [(prefix + ATTENTION[rest], tensor)]
    if rest == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2, dim=0)
        return [(f"{prefix}mlp.gate_proj.weight", gate), (f"{prefix}mlp.up_proj.weight", up)]
    if rest in MLP:
        return [(prefix + MLP[rest], tensor)]
    return None


def attention_from_hf(get: Get, layer: int, cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    yield mg + "input_layernorm.weight", get(hf + "input_layernorm.weight")
    q, k, v = (get(f"{hf}self_attn.{p}_proj.weight") for p in "qkv")
    yield mg + "self_attention.linear_qkv.weight", join_qkv(q, k, v, cfg)
    if cfg.qk_layernorm:
        yield mg + "self_attention.q_layernorm.weight", get(hf + "self_attn.q_norm.weight")
        yield mg + "self_attention.k_layernorm.weight", get(hf + "self_attn.k_norm.weight")
    yield mg + "self_attention.linear_proj.weight", get(hf + "self_attn.o_proj.weight")
    yield mg + "pre_mlp_layernorm.weight", get(hf + "post_attention_layernorm.weight")


def to_hf(name: str, tensor: Tensor, cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    if name in TOP:
        if name == "output_layer.weight" and cfg.tie_word_embeddings:
            return []
        return [(TOP[name], tensor)]
    if name.startswith("decoder.layers."):
        layer, rest = name.removeprefix("decoder.layers.").split(".", 1)
        mapped = layer_to_hf(rest, tensor, f"model.layers.{layer}.", cfg)
        if mapped is not None:
            return mapped
    raise KeyError(f"{cfg.family}: no Hugging Face name for megatron tensor {name!r}")


def from_hf(get: Get, cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    yield "embedding.word_embeddings.weight", get("model.embed_tokens.weight")
    for layer in range(cfg.num_layers):
        yield from attention_from_hf(get, layer, cfg)
        hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        gate, up = get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")
        yield mg + "mlp.linear_fc1.weight", torch.cat([gate, up], dim=0)
        yield mg + "mlp.linear_fc2.weight", get(hf + "mlp.down_proj.weight")
    yield "decoder.final_layernorm.weight", get("model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield "output_layer.weight", get("lm_head.weight")
