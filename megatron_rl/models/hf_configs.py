"""`config.json` <-> `ModelConfig`: the fields every family shares, and the check that they agree.

A family module builds on these: `hf_config(cfg)` (the arguments of its transformers config class) and
`model_config(hf)` (ModelConfig fields read from a config.json). Both RoPE spellings are read: the
`rope_parameters` of transformers >= 5 and the `rope_theta` + `rope_scaling` of the checkpoints on the
Hub; `rope_parameters` is written.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config import ModelConfig, MoEConfig

CHECKED_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "head_dim",
    "vocab_size",
    "rotary_base",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
    "norm_epsilon",
    "tie_word_embeddings",
    "qk_layernorm",
    "qk_l2_norm",
    "no_rope_freq",
    "attention_chunk_size",
    "attn_temperature_tuning",
)
MOE_FIELDS = ("num_experts", "router_topk", "ffn_hidden_size", "shared_expert_ffn_hidden_size", "layer_freq")


def rope_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {
        "rope_type": "llama3",
        "rope_theta": cfg.rotary_base,
        "factor": cfg.rope_scaling_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_position,
    }


def common_hf(cfg: ModelConfig) -> dict[str, Any]:
    """config.json fields shared by Llama, Qwen3, Qwen3-MoE and Llama-4 (text)."""
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_parameters": rope_hf(cfg),
        "hidden_act": "silu",
        "attention_bias": False,
    }


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    base = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {"rotary_base": float(base), "rope_scaling_factor": None}
    if kind != "llama3":
        raise ValueError(f"config.json: RoPE type {kind!r} is not supported (supported: default, llama3)")
    defaults = ModelConfig()
    return {
        "rotary_base": float(base),
        "rope_scaling_factor": float(rope["factor"]),
        "rope_low_freq_factor": float(rope.get("low_freq_factor", defaults.rope_low_freq_factor)),
        "rope_high_freq_factor": float(rope.get("high_freq_factor", defaults.rope_high_freq_factor)),
        "rope_original_max_position": int(
            rope.get("original_max_position_embeddings", defaults.rope_original_max_position)
        ),
    }


def common_fields(hf: dict[str, Any]) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads,
        "vocab_size": hf["vocab_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", ModelConfig().max_position_embeddings),
        "norm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **rope_fields(hf),
    }


def unsupported(hf: dict[str, Any], family: str, **expected: Any) -> None:
    """Raise if config.json asks for something the megatron model does not implement."""
    wrong = {k: hf[k] for k, v in expected.items() if k in hf and hf[k] not in (v if isinstance(v, tuple) else (v,))}
    if wrong:
        raise ValueError(
            f"config.json ({family}): not supported by the megatron model: "
            + ", ".join(f"{k}={v!r} (supported: {expected[k]!r})" for k, v in wrong.items())
        )


def build_model_config(name: str, family: str, fields: dict[str, Any], moe: dict[str, Any] | None) -> ModelConfig:
    return ModelConfig(name=name, family=family, moe=MoEConfig(**(moe or {})), **fields)  # type: ignore[arg-type]


def _checked(cfg: ModelConfig) -> dict[str, Any]:
    values = {field: getattr(cfg, field) for field in CHECKED_FIELDS}
    if any(not (cfg.is_moe and (i + 1) % cfg.moe.layer_freq == 0) for i in range(cfg.num_layers)):
        values["ffn_hidden_size"] = cfg.ffn_hidden_size  # only dense layers use it
    if cfg.attn_temperature_tuning:
        values.update(floor_scale=cfg.floor_scale, attn_scale=cfg.attn_scale)
    values["moe.num_experts"] = cfg.moe.num_experts
    if cfg.is_moe:
        for field in MOE_FIELDS + ("router_score_function", "router_pre_softmax", "apply_probs_on_input"):
            values[f"moe.{field}"] = getattr(cfg.moe, field)
        values["moe.ffn_hidden_size"] = cfg.moe.ffn_hidden_size or cfg.ffn_hidden_size
    return values


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    return bool(a == b)


def differences(cfg: ModelConfig, other: ModelConfig, labels: tuple[str, str] = ("config", "config.json")) -> list[str]:
    """Architecture fields where two model configs disagree (by default: ours and an HF config.json's)."""
    mine, theirs = _checked(cfg), _checked(other)
    return [
        f"model.{k} ({labels[0]} {mine.get(k)!r}, {labels[1]} {theirs.get(k)!r})"
        for k in sorted(mine.keys() | theirs.keys())
        if not _same(mine.get(k), theirs.get(k))
    ]
