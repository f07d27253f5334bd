"""Tiny Hugging Face models built locally: the starting checkpoints of tests and of the CPU run.

`build_tiny_model` writes a complete HF directory (config.json, model.safetensors, generation config,
tokenizer with chat template) from a `ModelConfig`, with random weights from a seed. SGLang serves it,
transformers loads it, and the converter imports it into Megatron, exactly as a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config import ModelConfig
from megatron_rl.data.tokenizer import build_tokenizer


def llama_hf_config(cfg: ModelConfig, eos_token_id: int, pad_token_id: int):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    if cfg.family != "llama":
        raise ValueError(f"model.family: tiny models are built for 'llama' here, got {cfg.family!r}")
    rope_scaling = None
    if cfg.rope_scaling_factor is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position,
        }
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rotary_base,
        rope_scaling=rope_scaling,
        rms_norm_eps=cfg.norm_epsilon,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        torch_dtype="float32",
    )


def build_tiny_model(out_dir: str | Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """Write a random-weight HF checkpoint with its tokenizer to `out_dir` and return the path."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    build_tokenizer(out_dir, vocab_size=min(cfg.vocab_size, 512), model_max_length=cfg.max_position_embeddings)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"model.vocab_size: {cfg.vocab_size} is smaller than the tokenizer ({len(tokenizer)})")
    hf_config = llama_hf_config(cfg, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    return out_dir
