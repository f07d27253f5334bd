"""The pieces every family mapping is made of: attention, gated MLPs, norms, experts.

Canonical megatron names (trainer/weights.py) of one decoder layer, and their Hugging Face names for the
Llama / Qwen layout (`{mlp}` is `mlp` for Llama and Qwen, `feed_forward` for Llama-4):

    decoder.layers.{i}.input_layernorm.weight             model.layers.{i}.input_layernorm.weight
    ...self_attention.linear_qkv.weight                   ...self_attn.{q,k,v}_proj.weight   (grouped, below)
    ...self_attention.{q,k}_layernorm.weight  (Qwen3)     ...self_attn.{q,k}_norm.weight
    ...self_attention.linear_proj.weight                  ...self_attn.o_proj.weight
    ...pre_mlp_layernorm.weight                           ...post_attention_layernorm.weight
    ...mlp.linear_fc1.weight  = [gate; up]                ...{mlp}.gate_proj.weight, ...{mlp}.up_proj.weight
    ...mlp.linear_fc2.weight                              ...{mlp}.down_proj.weight

megatron's fused QKV is grouped by key/value head: for each of the `num_query_groups` groups, its
`heads / groups` query heads, then its key head, then its value head (`head_dim` rows each). Under TP
each rank holds whole groups, so gathering (weights.py) is a plain concatenation of the shards; the
fused gate/up `linear_fc1` is not: each TP shard is [gate_i; up_i] and weights.py re-joins it as
[gate; up] before it reaches these functions.

The HF -> megatron direction is declarative: a family lists `FromHF` recipes (the canonical tensor, the
HF tensors it reads, how to build it), so an importer knows every HF name up front (missing and extra
tensors are reported before anything is read) and a rank reads only the tensors it keeps.
The megatron -> HF direction maps one canonical tensor at a time; HF tensors that fuse several
megatron tensors (Llama-4's per-layer expert stacks) come back as `Stacked` parts that `HFMapper`
(models/__init__.py) assembles.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

from megatron_rl.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where tensors are touched: reading a config.json needs none (driver)
    from torch import Tensor


class Reader(Protocol):
    """Tensors of an HF checkpoint by name (hf_files.HFReader)."""

    def get(self, name: str) -> Tensor: ...

    def get_index(self, name: str, index: int) -> Tensor:
        """`tensor[index]` along the first dimension, reading only that slice."""
        ...


@dataclass(frozen=True)
class FromHF:
    """One canonical megatron tensor, built from the HF tensors named in `reads`."""

    name: str
    reads: tuple[str, ...]
    build: Callable[[Reader], Tensor]


@dataclass(frozen=True)
class Stacked:
    """Entry `index` of an HF tensor that stacks `count` megatron tensors along a new first dimension."""

    index: int
    count: int
    tensor: Tensor


HFTensors: TypeAlias = "list[tuple[str, Tensor | Stacked]]"


def copy(name: str, hf: str) -> FromHF:
    return FromHF(name, (hf,), lambda r: r.get(hf))


# --------------------------------------------------------------------------------------------------
# Attention


def split_qkv(qkv: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    groups, per_group, dim = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    if qkv.shape[0] != groups * (per_group + 2) * dim:
        raise ValueError(
            f"linear_qkv: expected {groups * (per_group + 2) * dim} rows ({groups} groups x ({per_group} query "
            f"+ 1 key + 1 value heads) x head_dim {dim}), got {tuple(qkv.shape)}"
        )
    grouped = qkv.view(groups, per_group + 2, dim, -1)
    q = grouped[:, :per_group].reshape(groups * per_group * dim, -1)
    return q, grouped[:, per_group].reshape(groups * dim, -1), grouped[:, per_group + 1].reshape(groups * dim, -1)


def join_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    groups, per_group, dim = cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, cfg.head_dim
    expected = {"q_proj": groups * per_group * dim, "k_proj": groups * dim, "v_proj": groups * dim}
    hidden = q.shape[-1]
    for proj, tensor in zip(expected, (q, k, v), strict=True):
        if tensor.dim() != 2 or tensor.shape[0] != expected[proj] or tensor.shape[1] != hidden:
            raise ValueError(f"{proj}: expected shape ({expected[proj]}, {hidden}), got {tuple(tensor.shape)}")
    import torch

    parts = [q.view(groups, per_group, dim, hidden), k.view(groups, 1, dim, hidden), v.view(groups, 1, dim, hidden)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


ATTENTION = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}


def attention_to_hf(rest: str, tensor: Tensor, prefix: str, cfg: ModelConfig) -> HFTensors | None:
    """Attention and the two norms of one layer (`rest`: the name after `decoder.layers.{i}.`)."""
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = split_qkv(tensor, cfg)
        return [(f"{prefix}self_attn.{p}_proj.weight", t) for p, t in zip("qkv", (q, k, v), strict=True)]
    if rest in ATTENTION:
        return [(prefix + ATTENTION[rest], tensor)]
    return None


def attention_from_hf(layer: int, cfg: ModelConfig) -> Iterator[FromHF]:
    hf, mg = f"model.layers.{layer}.", f"decoder.layers.{layer}."
    yield copy(mg + "input_layernorm.weight", hf + "input_layernorm.weight")
    q, k, v = (f"{hf}self_attn.{p}_proj.weight" for p in "qkv")
    yield FromHF(
        mg + "self_attention.linear_qkv.weight", (q, k, v), lambda r: join_qkv(r.get(q), r.get(k), r.get(v), cfg)
    )
    if cfg.qk_layernorm:
        yield copy(mg + "self_attention.q_layernorm.weight", hf + "self_attn.q_norm.weight")
        yield copy(mg + "self_attention.k_layernorm.weight", hf + "self_attn.k_norm.weight")
    yield copy(mg + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight")
    yield copy(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight")


# --------------------------------------------------------------------------------------------------
# Gated MLP (dense layers, shared experts, per-expert Qwen3-MoE experts)


def split_fc1(fc1: Tensor) -> tuple[Tensor, Tensor]:
    if fc1.shape[0] % 2:
        raise ValueError(f"linear_fc1 of a gated MLP must have an even number of rows, got {tuple(fc1.shape)}")
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def join_fc1(gate: Tensor, up: Tensor) -> Tensor:
    if gate.shape != up.shape:
        raise ValueError(f"gate_proj and up_proj differ in shape: {tuple(gate.shape)} vs {tuple(up.shape)}")
    import torch

    return torch.cat([gate, up], dim=0)


def mlp_to_hf(leaf: str, tensor: Tensor, hf_prefix: str) -> HFTensors | None:
    """One tensor of a gated MLP (`leaf`: `linear_fc1.weight` or `linear_fc2.weight`) -> `{hf_prefix}*_proj.weight`."""
    if leaf == "linear_fc1.weight":
        gate, up = split_fc1(tensor)
        return [(hf_prefix + "gate_proj.weight", gate), (hf_prefix + "up_proj.weight", up)]
    if leaf == "linear_fc2.weight":
        return [(hf_prefix + "down_proj.weight", tensor)]
    return None


def mlp_from_hf(mg_prefix: str, hf_prefix: str) -> Iterator[FromHF]:
    gate, up = hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight"
    yield FromHF(mg_prefix + "linear_fc1.weight", (gate, up), lambda r: join_fc1(r.get(gate), r.get(up)))
    yield copy(mg_prefix + "linear_fc2.weight", hf_prefix + "down_proj.weight")


# --------------------------------------------------------------------------------------------------
# Whole model


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """HF convention (and ours, trainer/model.py): layer i is MoE when (i + 1) % layer_freq == 0."""
    return cfg.is_moe and (layer + 1) % cfg.moe.layer_freq == 0


TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def top_to_hf(name: str, tensor: Tensor, cfg: ModelConfig) -> HFTensors | None:
    if name not in TOP:
        return None
    if name == "output_layer.weight" and cfg.tie_word_embeddings:
        raise ValueError("output_layer.weight: the model ties its embeddings, there is no separate output layer")
    return [(TOP[name], tensor)]


def split_layer_name(name: str) -> tuple[int, str] | None:
    if not name.startswith("decoder.layers."):
        return None
    layer, rest = name.removeprefix("decoder.layers.").split(".", 1)
    return int(layer), rest


def decoder_to_hf(
    name: str, tensor: Tensor, cfg: ModelConfig, feed_forward: Callable[[str, str, Tensor], HFTensors | None]
) -> HFTensors:
    """One canonical tensor under HF names, as every family maps it: the embedding, final norm and head, and each
    layer's attention and norms; the rest of a layer (`rest` after `decoder.layers.{i}.`) by the family's
    `feed_forward(rest, "model.layers.{i}.", tensor)`. KeyError for a tensor no rule maps."""
    mapped = top_to_hf(name, tensor, cfg)
    split = split_layer_name(name)
    if mapped is None and split is not None:
        layer, rest = split
        prefix = f"model.layers.{layer}."
        mapped = attention_to_hf(rest, tensor, prefix, cfg)
        if mapped is None:
            mapped = feed_forward(rest, prefix, tensor)
    if mapped is None:
        raise KeyError(f"{cfg.family}: no Hugging Face name for megatron tensor {name!r}")
    return mapped


def model_from_hf(cfg: ModelConfig, mlp_from_hf_of_layer: Callable[[int], Iterator[FromHF]]) -> Iterator[FromHF]:
    """Every canonical tensor of the model (embedding, layers, final norm, output layer unless tied)."""
    yield copy("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    for layer in range(cfg.num_layers):
        yield from attention_from_hf(layer, cfg)
        yield from mlp_from_hf_of_layer(layer)
    yield copy("decoder.final_layernorm.weight", "model.norm.weight")
    if not cfg.tie_word_embeddings:
        yield copy("output_layer.weight", "lm_head.weight")


def canonical_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The full shape of a canonical megatron tensor of `cfg` (what a TP=1/PP=1/EP=1 model holds)."""
    hidden, dim = cfg.hidden_size, cfg.head_dim
    ffn = cfg.ffn_hidden_size
    if ".experts.local_experts." in name:
        ffn = cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size
    elif ".shared_experts." in name:
        ffn = cfg.moe.shared_expert_ffn_hidden_size or 0
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (cfg.vocab_size, hidden)
    if name.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")):
        return (dim,)
    if name.endswith("layernorm.weight"):
        return (hidden,)
    if name.endswith("linear_qkv.weight"):
        return ((cfg.num_attention_heads + 2 * cfg.num_query_groups) * dim, hidden)
    if name.endswith("linear_proj.weight"):
        return (hidden, cfg.num_attention_heads * dim)
    if name.endswith("router.weight"):
        return (cfg.moe.num_experts or 0, hidden)
    if name.endswith("linear_fc1.weight"):
        return (2 * ffn, hidden)
    if name.endswith("linear_fc2.weight"):
        return (hidden, ffn)
    raise KeyError(f"no shape rule for megatron tensor {name!r}")
