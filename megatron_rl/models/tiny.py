"""Tiny random Hugging Face checkpoints of every family, built locally: the starting models of tests,
benchmarks and the CPU run.

    build_tiny_model(out_dir, cfg, seed)         # config.json, model.safetensors, tokenizer, generation config

The config is the family's `hf_config(cfg)` through its transformers config class; the model is
transformers' own class for it (`LlamaForCausalLM`, `Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`,
`Llama4ForCausalLM`), with transformers' initialisation drawn from the seed. With `std`, every tensor is
redrawn instead, norms around 1 and projections with spread `std` (larger than transformers' init), so
that a mapping that swaps two norms or two experts changes the logits visibly (the conversion tests).
SGLang serves the result, transformers loads it, and the converter imports it, exactly as a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config import ModelConfig
from megatron_rl.data.tokenizer import build_tokenizer
from megatron_rl.models import family


def build_tiny_model(out_dir: str | Path, cfg: ModelConfig, seed: int = 0, std: float | None = None) -> Path:
    """Write a random-weight fp32 HF checkpoint of `cfg` (any family) with a tokenizer; returns the path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    family(cfg).check(cfg)
    out = Path(out_dir)
    build_tokenizer(out, vocab_size=min(cfg.vocab_size, 512), model_max_length=cfg.max_position_embeddings)
    tokenizer = AutoTokenizer.from_pretrained(out)
    if len(tokenizer) > cfg.vocab_size:
        raise ValueError(f"model.vocab_size: {cfg.vocab_size} is smaller than the tokenizer ({len(tokenizer)})")
    kwargs = family(cfg).hf_config(cfg)
    model_type = kwargs.pop("model_type")
    ids = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    config = AutoConfig.for_model(model_type, **kwargs, **ids, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if std is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=generator)
                param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else std * noise)
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    return out
