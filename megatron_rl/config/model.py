"""The model section: architecture, MoE, and the parallel layout a model config was sized for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.errors import fail


@dataclass
class MoEConfig:
    """Mixture-of-experts settings; `num_experts: null` means a dense model."""

    num_experts: int | None = None
    """Routed experts per MoE layer (Llama-4 Scout: 16; Qwen3-30B-A3B: 128)."""
    router_topk: int = 1
    """Experts each token is routed to."""
    ffn_hidden_size: int | None = None
    """Hidden size of one routed expert's MLP (defaults to model.ffn_hidden_size)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Hidden size of the always-on shared expert (Llama-4: one of the expert's size); null = none."""
    layer_freq: int = 1
    """Every Nth layer is MoE (1 = all layers); Llama-4 Maverick interleaves, Scout does not."""
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router gate: softmax (Qwen3-MoE) or sigmoid (Llama-4)."""
    router_pre_softmax: bool = False
    """Softmax over all experts before top-k (Qwen3-MoE `norm_topk_prob=False`)."""
    apply_probs_on_input: bool = False
    """Multiply the router weight into the expert input rather than its output (Llama-4)."""
    aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 = off; RL fine-tuning usually keeps it off)."""
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """megatron-core token dispatcher. alltoall runs on CPU too (the CPU compatibility layer stands in for its
    CUDA stream); allgather refuses packed rows."""

    def __post_init__(self) -> None:
        if self.num_experts is not None:
            if self.num_experts < 1:
                fail("num_experts", f"must be >= 1 or null, got {self.num_experts}")
            if not 1 <= self.router_topk <= self.num_experts:
                fail("router_topk", f"must be in [1, num_experts={self.num_experts}], got {self.router_topk}")
        if self.layer_freq < 1:
            fail("layer_freq", f"must be >= 1, got {self.layer_freq}")


@dataclass
class ParallelLayout:
    """The parallel layout a model config was sized for (documentation plus a default)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute this layout needs (`trainer.recompute.granularity` unless the recipe sets it)."""
    trainer_gpus: int = 1
    generator_gpus: int = 0
    generator_tp: int = 1


@dataclass
class ModelConfig:
    """Transformer architecture; one YAML file per model in model_configs/."""

    name: str = "tiny_dense"
    """Model config name (file stem in model_configs/)."""
    family: Literal["llama", "qwen3", "qwen3_moe", "llama4"] = "llama"
    """HF family: selects the conversion mapping and architecture details."""
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 176
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """KV heads (GQA); equal to num_attention_heads for MHA."""
    kv_channels: int | None = None
    """Head dimension; null = hidden_size / num_attention_heads."""
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    rotary_base: float = 10000.0
    rope_scaling_factor: float | None = None
    """Llama-3.1 style RoPE frequency scaling factor (8.0 for Llama-3.1); null = none."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    qk_layernorm: bool = False
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    qk_l2_norm: bool = False
    """Weightless L2 norm on q/k of RoPE layers (Llama-4)."""
    no_rope_freq: int | None = None
    """Every Nth layer uses no RoPE (Llama-4: 4); null = RoPE everywhere."""
    attention_chunk_size: int | None = None
    """Llama-4 chunked local attention on the RoPE layers: a token attends only to earlier tokens of its own
    `attention_chunk_size`-token chunk (Scout: 8192); null = full causal attention on every layer."""
    attn_temperature_tuning: bool = False
    """Llama-4 attention-temperature tuning on the NoPE layers: queries at position p are scaled by
    1 + attn_scale * log(floor((p + 1) / floor_scale) + 1) (HF `Llama4TextAttention`)."""
    floor_scale: int = 8192
    """Llama-4 temperature tuning: positions per temperature step (Scout: 8192)."""
    attn_scale: float = 0.1
    """Llama-4 temperature tuning: scale of the log term (Scout: 0.1)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    """The layout this config was sized for (see model_configs/*.yaml)."""
    hf_path: str | None = None
    """HF checkpoint directory to start from; null = random init (tests and the CPU demo)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size"):
            if getattr(self, name) < 1:
                fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            fail(
                "num_query_groups",
                f"must divide num_attention_heads={self.num_attention_heads}, got {self.num_query_groups}",
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            fail("kv_channels", "must be set when hidden_size is not a multiple of num_attention_heads")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            fail(
                "attention_chunk_size",
                "must be a positive number of tokens or null, got " + str(self.attention_chunk_size),
            )
        if self.floor_scale < 1:
            fail("floor_scale", f"must be >= 1, got {self.floor_scale}")

    @property
    def is_moe(self) -> bool:
        return self.moe.num_experts is not None

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads
