"""Typed run configuration: dataclasses, YAML recipes, dotted overrides, validation.

This module owns the shape of a megatron_rl run. A run is one `RunConfig`, built from

    recipe YAML (with `base:` inheritance)  ->  model config YAML (model_configs/)  ->  dotted overrides

and validated on construction: every error names the dotted field to change and, for a choice, the
allowed values. The resolved config is written into the run directory (`save_config`).

Defaults are the ScaleRL recipe of docs/recipe.md (the paper's values); choices the paper leaves
open are marked "(ours)" in the field docstrings.

This module imports no torch, Megatron, SGLang or Ray (tests/unit/test_config.py proves it): the CLI,
the Slurm launcher and the recipe checks parse configs without paying for heavy imports.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

PACKAGE_DIR = Path(__file__).resolve().parent
RECIPES_DIR = PACKAGE_DIR / "recipes"
MODEL_CONFIGS_DIR = PACKAGE_DIR.parent / "model_configs"


class ConfigError(ValueError):
    """A configuration value is wrong. The message starts with the dotted field name."""


def _fail(name: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{name}: {message}")


# --------------------------------------------------------------------------------------------------
# Model


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
                _fail("num_experts", f"must be >= 1 or null, got {self.num_experts}")
            if not 1 <= self.router_topk <= self.num_experts:
                _fail("router_topk", f"must be in [1, num_experts={self.num_experts}], got {self.router_topk}")
        if self.layer_freq < 1:
            _fail("layer_freq", f"must be >= 1, got {self.layer_freq}")


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
                _fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            _fail(
                "num_query_groups",
                f"must divide num_attention_heads={self.num_attention_heads}, got {self.num_query_groups}",
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            _fail("kv_channels", "must be set when hidden_size is not a multiple of num_attention_heads")
        if self.attention_chunk_size is not None and self.attention_chunk_size < 1:
            _fail(
                "attention_chunk_size",
                "must be a positive number of tokens or null, got " + str(self.attention_chunk_size),
            )
        if self.floor_scale < 1:
            _fail("floor_scale", f"must be >= 1, got {self.floor_scale}")

    @property
    def is_moe(self) -> bool:
        return self.moe.num_experts is not None

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


# --------------------------------------------------------------------------------------------------
# Trainer


@dataclass
class ParallelConfig:
    """How trainer ranks split the model, by megatron-core's rules (`parallel_state.initialize_model_parallel`).

    Dense layers: world = tp x cp x pp x dp. Expert layers: world = etp x ep x pp x edp (expert data parallel).
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    """Context parallel: every sequence of a packed row is split over `cp` ranks, as Transformer Engine's THD
    context parallelism expects (2 x cp chunks per sequence, rank r holds chunks r and 2cp-1-r); attention
    exchanges keys and values over the CP group, everything else runs on the rank's tokens only (activation
    memory / cp). The CP ranks of one data-parallel replica train on the same sequences."""
    ep: int = 1
    etp: int | None = None
    """Expert tensor parallel: how many ranks split one expert's MLP. null = 1 for MoE models (each expert
    whole on its rank: no TP all-reduces inside the experts), tp for dense ones (unused there)."""
    trainer_devices: int = 1
    """Trainer ranks in total (GPUs, or processes on CPU). dp = trainer_devices / (tp * cp * pp)."""
    sequence_parallel: bool = False
    """Shard the sequence over the TP group outside attention and MLP (activation memory / tp in norms and
    residuals); needs tp > 1, required by megatron-core for MoE with tp > 1. Packed rows are padded to a
    multiple of tp."""
    distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (megatron-core DistributedOptimizer)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "trainer_devices"):
            if getattr(self, name) < 1:
                _fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp < 1:
            _fail("etp", f"must be >= 1 or null, got {self.etp}")
        if self.trainer_devices % (self.tp * self.cp * self.pp):
            layout = f"tp x pp = {self.tp} x {self.pp}"
            if self.cp > 1:
                layout = f"tp x cp x pp = {self.tp} x {self.cp} x {self.pp}"
            _fail("trainer_devices", f"world size {self.trainer_devices} must be a multiple of {layout}")
        if self.sequence_parallel and self.tp == 1:
            _fail("sequence_parallel", "needs tp > 1 (megatron-core: no sequence parallelism without TP)")

    @property
    def dp(self) -> int:
        return self.trainer_devices // (self.tp * self.cp * self.pp)

    def expert_tp(self, moe: bool) -> int:
        """The expert-tensor-parallel size in effect (`etp`, or its default for the model)."""
        if self.etp is not None:
            return self.etp
        return 1 if moe else self.tp

    def expert_dp(self, moe: bool) -> int:
        return self.trainer_devices // (self.expert_tp(moe) * self.ep * self.pp)

    @property
    def seq_pad_multiple(self) -> int:
        """Each sequence of a row is padded to a multiple of this: context parallel cuts it into 2 x cp chunks."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def pad_multiple(self) -> int:
        """Packed rows are padded to a multiple of this: each CP rank holds 1/cp of every sequence (each padded to
        2 x cp chunks), and sequence parallel splits a rank's part over the TP ranks."""
        return self.seq_pad_multiple * (self.tp if self.sequence_parallel else 1)

    def padded_length(self, tokens: int) -> int:
        """Tokens a sequence of `tokens` takes in a row (padded to `seq_pad_multiple`)."""
        return -(-tokens // self.seq_pad_multiple) * self.seq_pad_multiple

    def padded_row(self, lengths: list[int]) -> int:
        """Tokens a row holding sequences of `lengths` takes, padding included."""
        tokens = sum(self.padded_length(n) for n in lengths)
        return -(-tokens // self.pad_multiple) * self.pad_multiple


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "shared_experts", "moe_act")
"""megatron-core 0.19's selective-recompute modules that apply to these models (no MLA, no gated delta net)."""


@dataclass
class RecomputeConfig:
    """Activation recomputation, as megatron-core names it (`TransformerConfig.recompute_*`).

    none: keep every activation. selective: recompute the listed parts of each layer in backward (megatron's
    default is core attention). full: keep only each layer's input and recompute the whole layer; `method`
    uniform checkpoints groups of `num_layers` layers, block checkpoints the first `num_layers` layers of each
    pipeline stage and keeps the rest.
    """

    granularity: Literal["none", "selective", "full"] = "none"
    method: Literal["uniform", "block"] = "uniform"
    """full only."""
    num_layers: int = 1
    """full only: layers per checkpointed group (uniform) or checkpointed layers per stage (block)."""
    modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """selective only: any of core_attn, mlp, layernorm, moe, shared_experts, moe_act (moe_act needs an MoE
    model with grouped GEMM, `trainer.performance.moe_grouped_gemm`: megatron-core refuses it otherwise)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            _fail("num_layers", f"must be >= 1, got {self.num_layers}")
        unknown = sorted(set(self.modules) - set(RECOMPUTE_MODULES))
        if unknown:
            _fail("modules", f"{unknown} not among megatron-core's recompute modules {list(RECOMPUTE_MODULES)}")
        if self.granularity == "selective" and not self.modules:
            _fail("modules", "selective recompute needs at least one module")


def check_norm_recompute(recompute: RecomputeConfig, te: bool) -> None:
    """megatron-core 0.19.2 recomputes norms (`layernorm` in selective recompute) only with Transformer Engine:
    its CheckpointWithoutOutput reads TE's FP8 state unconditionally. Checked at config for the layer spec the
    run's trainer will use (RunConfig.check_recompute) and again where the model is built (trainer/model.py)."""
    if recompute.granularity == "selective" and "layernorm" in recompute.modules and not te:
        _fail(
            "trainer.recompute.modules",
            "'layernorm' needs Transformer Engine (megatron-core's norm recompute reads TE's FP8 state); use "
            "core_attn, mlp, moe or shared_experts with the local layer spec",
        )


GPU_IMAGE_HAS_APEX = False
"""Whether the GPU image (env/Dockerfile, env/megatron_rl.def, env/gpu-requirements.lock) builds NVIDIA Apex's CUDA
extensions. megatron-core's gradient-accumulation fusion in its own ColumnParallelLinear (GPTModel's output layer,
whatever the layer spec) needs Apex's `fused_weight_gradient_mlp_cuda`, and refuses to build the layer without it.
tests/unit/test_gpu_env.py keeps this in step with the image."""


@dataclass
class PerformanceConfig:
    """GPU kernels and fusions. null = on when the trainer runs Transformer Engine on CUDA, off otherwise
    (none of them exists for megatron-core's local spec on CPU); true/false forces the choice."""

    moe_grouped_gemm: bool | None = None
    """All local experts of a layer in one grouped GEMM (TE's GroupedLinear) instead of one after another."""
    moe_permute_fusion: bool | None = None
    """Fused token permute/unpermute around the MoE all-to-all."""
    bias_activation_fusion: bool | None = None
    """Fused SwiGLU (megatron's bias_swiglu kernel)."""
    bias_dropout_fusion: bool | None = None
    """Fused residual add (bias-dropout-add) after attention and MLP."""
    apply_rope_fusion: bool | None = None
    """Fused RoPE kernel (also for the packed THD layout)."""
    masked_softmax_fusion: bool | None = None
    """Fused scale-mask-softmax (used where attention is not TE's flash/fused kernel)."""
    gradient_accumulation_fusion: bool | None = None
    """Weight gradients accumulated straight into the fp32 main_grad buffer (fused wgrad GEMM). Needs NVIDIA Apex's
    `fused_weight_gradient_mlp_cuda` besides Transformer Engine (megatron's output layer refuses to build without
    it): null is on only where both are there, which the shipped GPU image is not (`GPU_IMAGE_HAS_APEX`)."""


@dataclass
class OptimizerConfig:
    """AdamW with a linear warm-up to a constant learning rate (docs/recipe.md §6)."""

    lr: float = 5e-7
    warmup_steps: int = 100
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    """(ours) the paper does not state betas; 0.95 is Megatron's RL default."""
    adam_eps: float = 1e-15
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    """Global gradient-norm clip (ours); 0 disables it."""
    cpu_offload: bool = False
    """Keep `offload_fraction` of the Adam state (fp32 master weights, both moments: 12 bytes per parameter) in
    host memory and update it there, megatron-core's HybridDeviceOptimizer (`optimizer_cpu_offload`). Needs the
    distributed optimizer; the plan counts the host memory it takes per node."""
    offload_fraction: float = 1.0
    """Share of the optimizer state (by parameters) kept on the host when `cpu_offload` is on."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            _fail("lr", f"must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            _fail("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            _fail("adam_beta1", "adam_beta1 and adam_beta2 must be in [0, 1)")
        if self.grad_clip < 0:
            _fail("grad_clip", f"must be >= 0, got {self.grad_clip}")
        if not 0.0 < self.offload_fraction <= 1.0:
            _fail("offload_fraction", f"must be in (0, 1], got {self.offload_fraction}")


@dataclass
class TrainerConfig:
    """The Megatron-Core trainer: precision, optimizer, micro-batching."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    params_dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of the transformer body. CPU tests use fp32 for exact comparisons."""
    fp32_lm_head: bool = True
    """Output layer weights, matmul and log-softmax in fp32 (docs/recipe.md §3; `loo-fp32` turns it off)."""
    micro_batch_tokens: int = 16512
    """Token budget of one packed micro-batch (padding included). It must hold the longest sequence a rollout
    can produce: max_prompt_tokens + max_thinking_tokens + the interruption phrase + answer_tokens (ScaleRL:
    2,048 + 12,288 + ~20 + 2,048 = 16,404; the default leaves room for the phrase and SP padding)."""
    logprob_chunk_mib: int = 64
    """Size of one [tokens x vocab/tp] fp32 logits chunk in the log-prob/entropy computation (ours): the
    chunk has max(1, logprob_chunk_mib MiB / (4 x vocab/tp)) tokens (128 at a 128k vocabulary, TP 1)."""
    warm_start_steps: int = 0
    """(CPU demo) supervised steps on a synthetic task's worked solutions before RL, for a model that
    starts from random weights (model.hf_path null); 0 = none."""
    warm_start_slip: float = 0.0
    """(CPU demo) chance per step of a worked solution that the warm-up's copy carries a slip (a column sum
    off by one, carried into the answer; data/synthetic.py): the policy learns the method and an error rate,
    as a pretrained model does, and RL has errors to remove. 0 = every warm-up solution is correct."""
    layer_spec: Literal["auto", "transformer_engine", "local"] = "auto"
    """auto = Transformer Engine when importable and CUDA is present, else megatron-core's local spec."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.warm_start_steps < 0:
            _fail("warm_start_steps", f"must be >= 0, got {self.warm_start_steps}")
        if not 0.0 <= self.warm_start_slip < 1.0:
            _fail("warm_start_slip", f"must be in [0, 1), got {self.warm_start_slip}")


# --------------------------------------------------------------------------------------------------
# Algorithm

LOSS_DEFAULT_EPS: dict[str, tuple[float, float]] = {
    # Paper's working values (docs/recipe.md §2): (eps_low, eps_high) of the PPO-style clip.
    "gspo": (3e-3, 5e-3),
    "dapo": (0.2, 0.28),
    "grpo": (0.2, 0.2),
    "cispo": (0.2, 0.28),  # unused: CISPO truncates at algo.eps_max, and its clip metric counts that truncation
}


@dataclass
class LengthPenaltyConfig:
    """DAPO's overlong reward shaping, used by the `loo-lp` ablation instead of interruption."""

    enabled: bool = False
    max_length: int = 14336
    """L_max: completion length at which the penalty reaches -1 (ours: thinking + answer budget)."""
    cache_length: int = 2048
    """L_cache: width of the soft-penalty ramp before max_length (ours)."""

    def __post_init__(self) -> None:
        if not 0 < self.cache_length <= self.max_length:
            _fail("cache_length", f"must be in (0, max_length={self.max_length}], got {self.cache_length}")


@dataclass
class AlgoConfig:
    """The RL objective: loss, ratio clipping, aggregation, advantage normalisation, filters."""

    loss: Literal["cispo", "gspo", "dapo", "grpo"] = "cispo"
    eps_max: float = 5.0
    """CISPO: absolute cap on the importance ratio (paper: 4, 5, 8 behave the same; 5 is ours)."""
    eps_low: float | None = None
    """PPO-clip lower epsilon; null = the loss's paper value (gspo 3e-3, dapo 0.2, grpo 0.2)."""
    eps_high: float | None = None
    """PPO-clip upper epsilon; null = the loss's paper value (gspo 5e-3, dapo 0.28, grpo 0.2)."""
    aggregation: Literal["prompt", "sample", "token"] = "prompt"
    advantage_norm: Literal["batch", "group", "none"] = "batch"
    advantage_eps: float = 1e-6
    """Added to the std in advantage normalisation (ours)."""
    zero_variance_filter: bool = True
    """Drop groups whose G rewards are all equal (no refill)."""
    no_positive_resampling: float | None = 0.9
    """Pass-rate threshold at which a prompt leaves all later epochs; null = off."""
    length_penalty: LengthPenaltyConfig = field(default_factory=LengthPenaltyConfig)
    truncated: Literal["exclude", "keep"] = "exclude"
    """Completions that hit the answer budget: exclude = left out of the effective batch and of their group's
    advantages (the paper's appendix: the effective batch after excluding truncated samples), counted in
    `train/truncated_excluded`; keep = trained on with their reward (-1 when unanswered)."""
    max_empty_batches: int = 20
    """Stop the run (checkpoint kept) after this many batches in a row in which the zero-variance filter left
    nothing to train on: the policy has collapsed or the data is all too hard or too easy, and the run would
    otherwise sample forever without a step (ours; verl's DAPO stops the same way). 0 = never stop."""

    routing_replay: Literal["none", "measure", "rollout"] = "none"
    """MoE only (docs/recipe.md §9). rollout: the experts the generator chose for every token come back with the
    completion and the trainer's forward and backward route by them (megatron-core's router replay; "R3");
    measure: they come back and the trainer's own routing is compared with them (train/routing_agreement)
    without replaying; none: no routing records."""
    tis_cap: float | None = None
    """Token-level truncated importance sampling for the generator/trainer mismatch: each token's policy
    gradient is taken on the trainer's own distribution (ratio to its detached log-prob) and weighted by
    min(pi_trainer / pi_generator, tis_cap), detached. null = off (the loss's ratio is to the generator, as
    CISPO's truncated weight already is)."""
    mismatch_mask: float | None = None
    """Sequence-level masking: a completion whose geometric-mean ratio pi_trainer / pi_generator over its loss
    tokens leaves [1 / mismatch_mask, mismatch_mask] is left out of the loss (counted in train/mismatch_masked).
    null = off."""

    def __post_init__(self) -> None:
        if self.tis_cap is not None and self.tis_cap <= 0:
            _fail("tis_cap", f"must be > 0 or null, got {self.tis_cap}")
        if self.mismatch_mask is not None and self.mismatch_mask <= 1:
            _fail("mismatch_mask", f"must be > 1 (bounds the geometric-mean ratio) or null, got {self.mismatch_mask}")
        if self.max_empty_batches < 0:
            _fail("max_empty_batches", f"must be >= 0, got {self.max_empty_batches}")
        low, high = LOSS_DEFAULT_EPS[self.loss]
        if self.eps_low is None:
            self.eps_low = low
        if self.eps_high is None:
            self.eps_high = high
        if self.eps_max <= 1.0:
            _fail("eps_max", f"must be > 1 (it caps the ratio rho), got {self.eps_max}")
        if not 0 <= self.eps_low < 1:
            _fail("eps_low", f"must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            _fail("eps_high", f"must be >= 0, got {self.eps_high}")
        if self.no_positive_resampling is not None and not 0 < self.no_positive_resampling <= 1:
            _fail("no_positive_resampling", f"must be in (0, 1] or null, got {self.no_positive_resampling}")


# --------------------------------------------------------------------------------------------------
# Rollout


@dataclass
class InterruptionConfig:
    """Length control by interruption (docs/recipe.md §5)."""

    enabled: bool = True
    min_thinking_tokens: int = 10240
    """Lower end of the per-sequence thinking budget, drawn uniformly (paper: 10k)."""
    max_thinking_tokens: int = 12288
    """Upper end of the draw and the hard thinking budget (paper: 12k of 12,288)."""
    phrase: str = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
    """Injected when thinking reaches its budget without `</think>`; masked out of the loss."""
    end_of_thinking: str = "</think>"
    lookahead_tokens: int = 0
    """(ours) Tokens past the thinking budget the first request may generate (at most `answer_tokens` of them
    count), so that a model closing its thinking near the budget answers in the same request instead of a
    second one. The tokens past the budget of a completion that did not close are dropped: worth it where
    interruptions are rare and requests dear relative to tokens (the CPU recipe), not where an interrupted
    completion would throw away up to `answer_tokens` (2,048 at ScaleRL's budgets). 0: the first request stops
    at the budget."""

    def __post_init__(self) -> None:
        if self.lookahead_tokens < 0:
            _fail("lookahead_tokens", f"must be >= 0, got {self.lookahead_tokens}")
        if not 0 < self.min_thinking_tokens <= self.max_thinking_tokens:
            _fail(
                "min_thinking_tokens",
                f"must be in (0, max_thinking_tokens={self.max_thinking_tokens}], got {self.min_thinking_tokens}",
            )


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            _fail("temperature", f"must be > 0 (RL needs sampling), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")


@dataclass
class EngineConfig:
    """SGLang generator servers.

    Several engines are balanced by the client (`generator/balancer.py`: least outstanding requests,
    retry on another engine), not by SGLang's router: weight pushes, pause/continue for in-flight updates,
    restarts and failure counts are per engine, so the orchestrator addresses each engine directly anyway.
    """

    kind: Literal["sglang"] = "sglang"
    num_engines: int = 1
    tp: int = 1
    """Tensor-parallel size of one SGLang engine (GPUs per engine)."""
    fp32_lm_head: bool = True
    """Start SGLang with its fp32 LM-head flag (docs/recipe.md §3)."""
    mem_fraction: float = 0.85
    dtype: Literal["bfloat16", "float32", "auto"] = "bfloat16"
    device: Literal["cuda", "cpu"] = "cuda"
    extra_args: list[str] = field(default_factory=list)
    """Extra `sglang.launch_server` flags, passed through verbatim."""
    ready_timeout_s: float | None = None
    """How long an engine may take from launch to ready (reading the checkpoint, compiling kernels) before the
    run fails naming it. null: 600 s plus 6 s per GB of the checkpoint's safetensors (a cold Scout engine reads
    218 GB: ~30 min)."""

    def __post_init__(self) -> None:
        if self.tp < 1:
            _fail("tp", f"must be >= 1, got {self.tp}")
        if self.ready_timeout_s is not None and not self.ready_timeout_s > 0:
            _fail(
                "ready_timeout_s", f"must be > 0 seconds (null: sized from the checkpoint), got {self.ready_timeout_s}"
            )
        if self.num_engines < 1:
            _fail("num_engines", f"must be >= 1, got {self.num_engines}")
        if not 0 < self.mem_fraction <= 1:
            _fail("mem_fraction", f"must be in (0, 1], got {self.mem_fraction}")


PHRASE_TOKEN_ALLOWANCE = 64
"""Tokens the interruption phrase may take in the engines' context (the default phrase is ~20 in Llama-3's and in
the tiny models' tokenizers)."""


@dataclass
class RolloutConfig:
    """Generation: engines, the asynchronous pipeline, batch shape and length budgets."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    mode: Literal["pipeline", "ppo_off_policy"] = "pipeline"
    """pipeline = PipelineRL-k (in-flight weight updates); ppo_off_policy = PPO-off-policy-k."""
    k: int = 8
    """Max policy versions between generation and use (pipeline), or minibatches per sync (off-policy)."""
    staleness: Literal["wait", "drop"] = "wait"
    """How k is kept: wait = the trainer waits for groups that would otherwise grow more than k versions
    old (docs/recipe.md §4, the paper's rule: nothing is dropped); drop = groups over k are dropped and counted
    (`train/stale_dropped`), which drops the longest completions most often."""
    prompts_per_step: int = 48
    generations_per_prompt: int = 16
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_prompt_tokens: int = 2048
    answer_tokens: int = 2048
    """Budget after the end of thinking (after interruption, up to this many tokens more)."""
    interruption: InterruptionConfig = field(default_factory=InterruptionConfig)
    weight_sync: Literal["distributed", "disk"] = "distributed"
    """Trainer -> engines transport: a process group (NCCL/gloo) or safetensors files (the fallback)."""
    sync_bucket_mb: int = 512
    sync_timeout_s: float = 300.0
    """Bound on every step of a weight push (each HTTP call, each bucket's broadcast, the group's
    rendezvous): an engine that has not answered by then (hung, stopped) fails the push, is restarted and
    caught up. Must cover loading one bucket on the slowest engine."""
    max_retries: int = 3
    """Retries of a request whose engine failed, on another engine or after restart."""

    def __post_init__(self) -> None:
        if self.k < 1:
            _fail("k", f"must be >= 1, got {self.k}")
        if self.sync_timeout_s <= 0:
            _fail("sync_timeout_s", f"must be > 0, got {self.sync_timeout_s}")
        if self.prompts_per_step < 1:
            _fail("prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        for name in ("answer_tokens", "max_prompt_tokens", "sync_bucket_mb"):
            if getattr(self, name) < 1:
                _fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.generations_per_prompt < 2:
            _fail(
                "generations_per_prompt",
                f"must be >= 2 (advantages compare within a group), got {self.generations_per_prompt}",
            )

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.generations_per_prompt

    @property
    def max_completion_tokens(self) -> int:
        return self.interruption.max_thinking_tokens + self.answer_tokens

    @property
    def context_length(self) -> int:
        """Tokens one sequence can reach: prompt, thinking, the interruption phrase (at most
        `PHRASE_TOKEN_ALLOWANCE`, checked against the tokenizer at start) and answer. The engines are started with
        it (SGLang's --context-length: it sizes each request's row of its request-to-token table from it)."""
        phrase = PHRASE_TOKEN_ALLOWANCE if self.interruption.enabled else 0
        return self.max_prompt_tokens + self.max_completion_tokens + phrase

    def check_phrase(self, phrase_tokens: int) -> None:
        if self.interruption.enabled and phrase_tokens > PHRASE_TOKEN_ALLOWANCE:
            _fail(
                "rollout.interruption.phrase",
                f"{phrase_tokens} tokens with this tokenizer; at most {PHRASE_TOKEN_ALLOWANCE} fit the engines'"
                " context (rollout.context_length)",
            )

    @property
    def batches_in_flight(self) -> int:
        """Batches of `prompts_per_step` groups generating or buffered at most: k (a round of frozen weights) for
        ppo_off_policy, min(2, k) for pipeline. A pipeline group started at version v is due at v + k, so with at
        most min(2, k) batches in flight at most one batch of groups is ever due at once (rollout/pipeline.py)."""
        return self.k if self.mode == "ppo_off_policy" else min(2, self.k)

    @property
    def groups_in_flight(self) -> int:
        """The pipeline's capacity: groups generating or buffered at most (the engines' peak load, plan.py)."""
        return self.batches_in_flight * self.prompts_per_step


# --------------------------------------------------------------------------------------------------
# Data, rewards, evaluation


@dataclass
class DatasetConfig:
    """One training source: a local jsonl/parquet file, a `datasets` hub name, or `synthetic:<task>`."""

    source: str = "synthetic:arithmetic"
    task: Literal["math", "code"] = "math"
    weight: float = 1.0
    """Mixing weight among the datasets of a multi-task run."""
    split: str = "train"
    subset: str | None = None
    """The `datasets` configuration name (e.g. DeepCoder's 'lcbv5'); hub sources only."""
    limit: int | None = None
    """Use only the first N rows (ours; for smoke runs)."""
    val_prompts: int | None = None
    """Held-out prompts of this dataset; null: `data.val_prompts`."""

    def __post_init__(self) -> None:
        if self.weight <= 0:
            _fail("weight", f"must be > 0, got {self.weight}")
        if self.val_prompts is not None and self.val_prompts < 0:
            _fail("val_prompts", f"must be >= 0, got {self.val_prompts}")

    @property
    def key(self) -> str:
        """How the run names this source (sampler weights, metrics, split seeds): `source[:subset]`."""
        return self.source if self.subset is None else f"{self.source}:{self.subset}"


@dataclass
class DataConfig:
    datasets: list[DatasetConfig] = field(default_factory=lambda: [DatasetConfig()])
    val_prompts: int = 1000
    """Prompts held out for validation, drawn deterministically from `seed` (paper: 1,000)."""
    seed: int = 0
    chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template."""
    system_prompt: str | None = None
    bad_rows: Literal["error", "skip"] = "error"
    """A malformed dataset row stops the run (error) or is skipped and counted (skip)."""

    def __post_init__(self) -> None:
        if not self.datasets:
            _fail("datasets", "at least one dataset is required")
        if self.val_prompts < 0:
            _fail("val_prompts", f"must be >= 0, got {self.val_prompts}")


@dataclass
class SandboxConfig:
    """Isolation limits for running model-written programs (rewards/sandbox.py)."""

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_output_bytes: int = 1 << 20
    workers: int = 4
    allow_unisolated: bool = False
    """Development switch: run code without isolation when bubblewrap is missing (loudly logged)."""

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s"):
            if getattr(self, name) < 0:
                _fail(name, f"must be >= 0 seconds, got {getattr(self, name)}")
        for name, least in (("memory_mb", 16), ("max_processes", 1), ("max_output_bytes", 1), ("workers", 1)):
            if getattr(self, name) < least:
                _fail(name, f"must be >= {least}, got {getattr(self, name)}")


@dataclass
class RewardsConfig:
    correct: float = 1.0
    incorrect: float = -1.0
    """Reward of a wrong (or unparseable, or failed) completion; the paper uses +1 / -1."""
    math_timeout_s: float = 5.0
    code_partial_credit: bool = False
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    processes: int = 2
    """Reward worker processes on the driver's node (each scores one completion at a time; a code reward's
    sandboxes run inside its worker, `sandbox.workers` at a time)."""

    def __post_init__(self) -> None:
        if self.processes < 1:
            _fail("processes", f"must be >= 1, got {self.processes}")


DOWNSTREAM_BENCHMARKS = ("aime24", "aime25", "math500", "livecodebench", "synthetic_large")
"""The downstream benchmarks data/benchmarks.py loads."""


def _iso_date(name: str, value: str | None) -> None:
    if value is None:
        return
    import datetime

    try:
        datetime.date.fromisoformat(value)
    except ValueError:
        _fail(name, f"expected a date YYYY-MM-DD, got {value!r}")


@dataclass
class BenchmarkConfig:
    """One downstream benchmark (data/benchmarks.py). In a list, `NAME` stands for {name: NAME} and
    `NAME=PATH` for {name: NAME, source: PATH}."""

    name: str = "aime24"
    """One of aime24, aime25, math500, livecodebench, synthetic_large (the CPU run's held-out sums >= 180)."""
    source: str | None = None
    """A local .jsonl/.parquet file in the published schema (LiveCodeBench: also a downloaded copy of its
    dataset repository), or another hub name; default: the benchmark's own hub name."""
    split: str | None = None
    """The hub split; default: the benchmark's (train for the AIME sets, test for MATH-500)."""
    limit: int | None = None
    """At most this many problems (the first ones, in file order)."""
    version: str = "release_v5"
    """LiveCodeBench: release_vN (all problems up to release N), vN (release N's alone) or release_latest."""
    start_date: str | None = "2024-08-01"
    """LiveCodeBench: keep problems whose contest date is on or after this (a model's cut-off)."""
    end_date: str | None = "2025-02-01"
    """LiveCodeBench: ... and on or before this (2024-08-01 .. 2025-02-01: the window DeepSeek-R1 reports)."""

    @classmethod
    def from_str(cls, text: str) -> BenchmarkConfig:
        name, _, source = text.partition("=")
        return cls(name=name.strip(), source=source.strip() or None)

    def __post_init__(self) -> None:
        if self.name not in DOWNSTREAM_BENCHMARKS:
            _fail("name", f"unknown benchmark {self.name!r}; known: {list(DOWNSTREAM_BENCHMARKS)}")
        if self.limit is not None and self.limit < 1:
            _fail("limit", f"must be >= 1, got {self.limit}")
        _iso_date("start_date", self.start_date)
        _iso_date("end_date", self.end_date)
        if self.start_date and self.end_date and self.start_date > self.end_date:
            _fail("end_date", f"{self.end_date} is before start_date {self.start_date}")


@dataclass
class DownstreamConfig:
    """Downstream benchmarks evaluated on the run's own engines (docs/recipe.md §8): at step 0 (the starting
    model), every `every_steps` and at the end; `megatron-rl eval` evaluates any checkpoint the same way."""

    benchmarks: list[BenchmarkConfig] = field(default_factory=list)
    """E.g. [aime24, math500, livecodebench] or [{name: math500, source: /data/math500.jsonl}]; empty: off."""
    every_steps: int = 100
    samples_per_prompt: int = 16
    """n samples per problem: mean@n, and the unbiased pass@k for k = 1, 2, 4, ... up to n."""
    temperature: float | None = None
    """Default: the rollout's sampling (the policy RL trains); the budgets are always the rollout's."""
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            _fail("every_steps", f"must be >= 1, got {self.every_steps}")
        if self.samples_per_prompt < 1:
            _fail("samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")
        if self.temperature is not None and self.temperature <= 0:
            _fail("temperature", f"must be > 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        names = [b.name for b in self.benchmarks]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            _fail("benchmarks", f"{repeated} listed twice (results are logged per benchmark name)")

    def sampling(self, rollout: SamplingConfig) -> SamplingConfig:
        """The eval's sampling: the rollout's, with this config's temperature and top-p where set."""
        return dataclasses.replace(
            rollout,
            temperature=rollout.temperature if self.temperature is None else self.temperature,
            top_p=rollout.top_p if self.top_p is None else self.top_p,
        )


@dataclass
class EvalConfig:
    every_steps: int = 100
    """Validation every N optimizer steps, and at step 0 (R0 of the scaling law)."""
    samples_per_prompt: int = 16
    """mean@k: the paper's mean@16, sampled as training samples (`rollout.sampling`: same engines, temperature
    and top-p), so the validation pass rate measures the policy that RL trains."""
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            _fail("every_steps", f"must be >= 1, got {self.every_steps}")
        if self.samples_per_prompt < 1:
            _fail("samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")


@dataclass
class LoggingConfig:
    wandb: Literal["online", "offline", "disabled"] = "offline"
    project: str = "megatron_rl"
    console_every_steps: int = 1
    live_scaling_fit: bool = True
    """Fit the scaling curve at each validation and log the predicted asymptote (per task too)."""
    scaling_fit_start: float = 0.0
    """Warm-up cut for the live and final fits, in device-hours: earlier points are not fitted (paper: 1,500
    GPU-hours)."""


@dataclass
class CheckpointConfig:
    every_steps: int = 100
    keep_last: int = 2
    resume: Literal["auto", "never"] = "auto"
    """auto = continue from the newest checkpoint in the run directory if there is one (the same experiment: a
    changed config is applied or refused field by field, orchestration/resume.py)."""
    fork_from: str | None = None
    """A run directory (or one of its checkpoints) whose latest weights this new run starts from, with a fresh
    optimizer, data order and step count (`megatron-rl train --fork RUN`); the model must be the same, anything
    else may differ. Once this run has checkpoints of its own, a restart resumes them."""
    save_on_signal: bool = True
    """Checkpoint and exit cleanly on SIGTERM / SIGUSR1 (Slurm's pre-timeout signal)."""

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            _fail("every_steps", f"must be >= 1, got {self.every_steps}")
        if self.keep_last < 1:
            _fail("keep_last", f"must be >= 1 (a run resumes from its newest checkpoint), got {self.keep_last}")


@dataclass
class ComputeConfig:
    """What counts as one device for the scaling law's x-axis (device-hours)."""

    device_kind: Literal["gpu", "cpu_core"] = "gpu"
    generator_devices: int | None = None
    """Devices the generators use; null = engine.num_engines * engine.tp."""
    device_memory_gib: float = 79.6
    """Usable memory of one GPU in GiB, for the memory plan (`megatron-rl plan`): H100 80GB reports 81,559 MiB."""
    host_memory_gib: float = 1800.0
    """Host memory of one node in GiB that its trainer ranks may use (a DGX H100 has 2 TB), for the plan's check of
    offloaded optimizer state and routing records (ranks per node: the allocation's GPUs per node, 8 without one)."""


# --------------------------------------------------------------------------------------------------
# The run


@dataclass
class RunConfig:
    """A whole run: one recipe, one model, and the overrides given on the command line."""

    name: str = "scalerl"
    recipe: str = "scalerl"
    output_dir: str = "runs"
    """Run directory parent; the run writes to <output_dir>/<name>/."""
    seed: int = 1234
    total_steps: int = 10000
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)

    def __post_init__(self) -> None:
        # Cross-section checks: each names the field to change.
        if self.total_steps < 1:
            _fail("total_steps", f"must be >= 1, got {self.total_steps}")
        d = self.data
        if not any(d.val_prompts if s.val_prompts is None else s.val_prompts for s in d.datasets):
            _fail(
                "data.val_prompts",
                "no dataset holds out validation prompts: a run's validation (R0 and every point of the scaling "
                "curve) needs at least one",
            )
        if not self.name or self.name in (".", "..") or Path(self.name).name != self.name or "\\" in self.name:
            _fail("name", f"must be one directory name inside output_dir (no '/' or '..'), got {self.name!r}")
        if self.rollout.interruption.enabled and self.algo.length_penalty.enabled:
            _fail(
                "algo.length_penalty.enabled",
                "length penalty and rollout.interruption are alternatives (loo-lp); enable only one",
            )
        p, m = self.parallel, self.model
        if m.num_attention_heads % p.tp or m.num_query_groups % p.tp:
            _fail(
                "parallel.tp",
                f"must divide the attention heads ({m.num_attention_heads}) and query groups "
                f"({m.num_query_groups}), got {p.tp}",
            )
        if m.ffn_hidden_size % p.tp:
            _fail("parallel.tp", f"must divide model.ffn_hidden_size={m.ffn_hidden_size}, got {p.tp}")
        if m.num_layers % p.pp:
            _fail("parallel.pp", f"must divide model.num_layers={m.num_layers}, got {p.pp}")
        if p.cp > 1 and self.compute.device_kind == "gpu" and self.trainer.layer_spec == "local":
            _fail(
                "parallel.cp",
                f"{p.cp} with trainer.layer_spec=local on GPUs: context parallelism there is Transformer Engine's "
                "attention (its ring exchange); the local spec's attention all-gathers every layer's keys and values "
                "over the CP group and keeps the whole row's for the backward (the CPU path), which is not what the "
                "plan counts. Use trainer.layer_spec=auto or transformer_engine",
            )
        if self.trainer.optimizer.cpu_offload and not p.distributed_optimizer:
            _fail(
                "trainer.optimizer.cpu_offload",
                "megatron-core offloads the optimizer state of its distributed optimizer only; set "
                "parallel.distributed_optimizer=true",
            )
        if self.algo.routing_replay != "none" and not m.is_moe:
            _fail("algo.routing_replay", f"routing replay needs an MoE model; {m.name} is dense (set it to none)")
        if p.ep > 1 and not m.is_moe:
            _fail("parallel.ep", f"expert parallel needs an MoE model; {m.name} is dense")
        if p.etp is not None and not m.is_moe and p.etp != p.tp:
            _fail("parallel.etp", f"expert tensor parallel applies to MoE models; {m.name} is dense (leave it null)")
        if m.is_moe:
            assert m.moe.num_experts is not None
            etp = p.expert_tp(True)
            if m.moe.num_experts % p.ep:
                _fail("parallel.ep", f"must divide model.moe.num_experts={m.moe.num_experts}, got {p.ep}")
            expert_ranks = etp * p.ep * p.pp
            if p.trainer_devices % expert_ranks:
                _fail(
                    "parallel.etp" if p.etp is not None else "parallel.ep",
                    "megatron-core forms expert layers as world = etp x ep x pp x expert-dp: world size "
                    f"{p.trainer_devices} is not a multiple of etp x ep x pp = {etp} x {p.ep} x {p.pp} "
                    f"= {expert_ranks}",
                )
            expert_ffn = m.moe.ffn_hidden_size or m.ffn_hidden_size
            if expert_ffn % etp:
                _fail("parallel.etp", f"must divide the expert ffn hidden size {expert_ffn}, got {etp}")
            if p.tp > 1 and not p.sequence_parallel:
                _fail("parallel.sequence_parallel", "megatron-core requires sequence parallel for MoE with tp > 1")
        self.check_recompute()
        self.check_kernels()
        self.check_row_budget(phrase_tokens=0)

    def check_engine_attention(self) -> None:
        """The engines can serve the model's attention: SGLang's CPU engine (torch-native attention) has no chunked
        local attention, so a Llama-4 whose chunk is shorter than the rollout's longest sequence would be served with
        full attention (the trainer alone, as in tests, runs it on CPU: this is checked where engines start)."""
        chunk = self.model.attention_chunk_size
        if self.rollout.engine.device == "cpu" and chunk is not None and chunk < self.rollout.context_length:
            _fail(
                "model.attention_chunk_size",
                f"{chunk} is shorter than rollout.context_length={self.rollout.context_length}, and SGLang's CPU "
                "engine (torch-native attention) has no chunked local attention: it would serve longer sequences "
                "with full attention. Lower the rollout's length budgets to the chunk or serve on GPUs",
            )

    def check_starting_model(self) -> None:
        """A GPU run starts RL from a pretrained checkpoint (`model.hf_path`); only a CPU run builds its tiny model
        itself. Checked by `check` (the Slurm bootstrap runs it before Ray starts) and by `train`, not when a config
        is loaded: plans and config checks of a GPU layout need no checkpoint."""
        if self.compute.device_kind == "gpu" and not self.model.hf_path:
            _fail(
                "model.hf_path",
                f"a GPU run starts RL from a pretrained Hugging Face checkpoint of {self.model.name}; set "
                "model.hf_path=/path/to/checkpoint (Slurm: MODEL_PATH=/path/to/checkpoint sbatch slurm/...)",
            )
        if self.model.hf_path:
            self.check_context(Path(self.model.hf_path))

    def check_context(self, hf_dir: Path) -> None:
        """The engines load `hf_dir` and refuse a --context-length beyond its config.json's positions: the
        rollout's longest sequence (`rollout.context_length`) must fit them."""
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            _fail("model.hf_path", f"{hf_dir} has no config.json (not a Hugging Face checkpoint directory)")
        hf = json.loads(path.read_text())
        positions = hf.get("max_position_embeddings") or (hf.get("text_config") or {}).get("max_position_embeddings")
        if positions and self.rollout.context_length > positions:
            _fail(
                "rollout.context_length",
                f"prompt + thinking + answer budgets and the interruption phrase ({self.rollout.context_length} "
                f"tokens) exceed the {positions} positions of {path} (max_position_embeddings): the engines refuse "
                "such a context; lower rollout.max_prompt_tokens, rollout.interruption.max_thinking_tokens or "
                "rollout.answer_tokens",
            )

    def check_kernels(self) -> None:
        """A fused kernel forced on where the run's nodes do not have it stops here, not at model build."""
        if self.trainer.performance.gradient_accumulation_fusion and not (
            self.trainer_uses_transformer_engine and GPU_IMAGE_HAS_APEX
        ):
            where = (
                "the GPU image does not build Apex" if self.compute.device_kind == "gpu" else "a CPU run has no CUDA"
            )
            _fail(
                "trainer.performance.gradient_accumulation_fusion",
                "true needs Transformer Engine and NVIDIA Apex's fused_weight_gradient_mlp_cuda kernel (megatron-core's"
                f" output layer refuses to build without it); {where}. Leave it null (on where the kernel is) or false",
            )

    @property
    def trainer_uses_transformer_engine(self) -> bool:
        """Whether the trainer builds with Transformer Engine's layer spec where it runs: a GPU run (the GPU
        image installs TE) whose `trainer.layer_spec` is not local; never on a CPU run."""
        return self.compute.device_kind == "gpu" and self.trainer.layer_spec != "local"

    def check_recompute(self) -> None:
        """megatron-core 0.19.2's rules for selective recompute, for the layer spec the trainer will use: norms
        only with Transformer Engine (`check_norm_recompute`); `moe_act` only with `moe_grouped_gemm`
        (TransformerConfig.__post_init__), which is off for a dense model and, when
        `trainer.performance.moe_grouped_gemm` is null, on only where the trainer runs Transformer Engine."""
        rc, t = self.trainer.recompute, self.trainer
        check_norm_recompute(rc, self.trainer_uses_transformer_engine)
        if rc.granularity != "selective" or "moe_act" not in rc.modules:
            return
        setting = t.performance.moe_grouped_gemm
        if not self.model.is_moe:
            why = f"model {self.model.name} is dense (grouped GEMM is an MoE setting, off without experts)"
        elif setting is False:
            why = "trainer.performance.moe_grouped_gemm=false"
        elif setting is None and (t.layer_spec == "local" or self.compute.device_kind != "gpu"):
            where = "trainer.layer_spec=local" if t.layer_spec == "local" else "a CPU run (compute.device_kind)"
            why = f"trainer.performance.moe_grouped_gemm=null resolves to off with {where}"
        else:
            return
        _fail(
            "trainer.recompute.modules",
            f"{rc.modules} has 'moe_act', which megatron-core recomputes only with grouped GEMM experts "
            f"(moe_grouped_gemm); {why}. Drop moe_act or recompute 'moe' instead",
        )

    def check_row_budget(self, phrase_tokens: int) -> None:
        """The longest sequence a rollout can make, padded for sequence parallel, must fit one micro-batch row:
        max_prompt_tokens + max_thinking_tokens + the interruption phrase + answer_tokens. The config check
        counts the phrase as 0 tokens; the driver checks again with the tokenizer's count."""
        r, p = self.rollout, self.parallel
        longest = r.max_prompt_tokens + r.interruption.max_thinking_tokens + r.answer_tokens
        longest += phrase_tokens if r.interruption.enabled else 0
        padded = p.padded_row([longest])
        if self.trainer.micro_batch_tokens < padded:
            phrase = f" + {phrase_tokens} phrase tokens" if phrase_tokens else ""
            rule = f"a multiple of {p.pad_multiple}"
            if p.cp > 1:
                rule = f"2 x cp = {p.seq_pad_multiple} chunks per sequence (parallel.cp={p.cp}), rows {rule}"
            _fail(
                "trainer.micro_batch_tokens",
                f"{self.trainer.micro_batch_tokens} cannot hold the longest sequence a rollout makes: "
                f"max_prompt_tokens + max_thinking_tokens + answer_tokens{phrase} = {longest} tokens "
                f"({padded} padded to {rule})" + ("" if phrase_tokens else ", plus the interruption phrase"),
            )

    @property
    def collective_timeout_s(self) -> float:
        """How long a trainer collective waits before NCCL's watchdog ends the rank: while rank 0 pushes a bucket
        to the engines (up to `rollout.sync_timeout_s`, then a restart and a second push) the other ranks wait in
        the next gather. torch's default (10 min) is shorter than a push with a large sync timeout; this is twice
        the push's worst case plus 10 min, and never less than megatron-core's own default of 30 min."""
        return max(1800.0, 2 * 2 * self.rollout.sync_timeout_s + 600.0)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


# --------------------------------------------------------------------------------------------------
# Building from plain data, with type checks that name the field


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check `value` against the annotation `tp`, converting where YAML/CLI text is ambiguous."""
    origin = get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        options = get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            _fail(name, "must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, name)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0])
    if origin is Literal:
        allowed = list(get_args(tp))
        if value not in allowed:
            _fail(name, f"{value!r} is not one of {allowed}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if not isinstance(value, list):
            _fail(name, f"expected a list, got {value!r}")
        return [_coerce(item, item_tp, f"{name}[{i}]") for i, item in enumerate(value)]
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, str) and hasattr(tp, "from_str"):  # a shorthand, e.g. a benchmark's name
            try:
                return tp.from_str(value)
            except ConfigError as exc:
                raise ConfigError(f"{name}.{exc}") from None
        if not isinstance(value, dict):
            _fail(name, f"expected a mapping of {tp.__name__} fields, got {value!r}")
        return build(tp, value, prefix=name)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        _fail(name, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            _fail(name, f"expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            _fail(name, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            _fail(name, f"expected a number, got {value!r}")
        try:
            number = float(value)  # YAML 1.1 reads "1e-6" as a string; accept it as a number here
        except (TypeError, ValueError):
            _fail(name, f"expected a number, got {value!r}")
        if not math.isfinite(number):
            _fail(name, f"expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            _fail(name, f"expected a string, got {value!r}")
        return str(value)
    raise TypeError(f"unsupported annotation {tp!r} for {name}")  # a bug in this module, not user input


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; unknown keys and bad values raise ConfigError."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    dotted = (prefix + ".") if prefix else ""
    unknown = sorted(set(data) - known)
    if unknown:
        _fail(f"{dotted}{unknown[0]}", f"unknown field of {cls.__name__}; known fields: {sorted(known)}")
    kwargs = {key: _coerce(value, hints[key], f"{dotted}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        message = str(exc)
        # Field names raised inside __post_init__ are relative; make them dotted from the root.
        if prefix and not message.startswith(dotted):
            message = dotted + message
        raise ConfigError(message) from None


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


# --------------------------------------------------------------------------------------------------
# YAML recipes, model configs and dotted overrides


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def list_model_configs() -> list[str]:
    return sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.yaml"))


def _resolve(name_or_path: str, directory: Path, what: str, known: list[str]) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = directory / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    raise ConfigError(f"{what}: no such {what} {name_or_path!r}; known: {known} (or give a path to a .yaml file)")


def load_recipe_dict(name_or_path: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A recipe's settings with its `base:` chain merged in (base first, the recipe on top)."""
    path = _resolve(name_or_path, RECIPES_DIR, "recipe", list_recipes())
    if path.stem in _seen:
        raise ConfigError(f"recipe: `base:` cycle {' -> '.join((*_seen, path.stem))}")
    data = _read_yaml(path)
    base = data.pop("base", None)
    data.pop("description", None)
    if base is None:
        return data
    return _deep_merge(load_recipe_dict(str(base), (*_seen, path.stem)), data)


def load_model_dict(name_or_path: str) -> dict[str, Any]:
    path = _resolve(name_or_path, MODEL_CONFIGS_DIR, "model", list_model_configs())
    data = _read_yaml(path)
    data.setdefault("name", path.stem)
    return data


def _parse_scalar(text: str) -> Any:
    """Parse an override's right-hand side as YAML (numbers, booleans, null, lists, quoted strings)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (the result is validated by `build`)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r}: expected the form section.field=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[leaf] = _parse_scalar(text)
    return data


def load_config(recipe: str = "scalerl", model: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """recipe YAML -> model config YAML (`model:` in the recipe, or the argument) -> overrides -> RunConfig."""
    data = load_recipe_dict(recipe)
    data.setdefault("recipe", Path(recipe).stem)
    data.setdefault("name", Path(recipe).stem)
    model_name = model or data.get("model", {}).get("name")
    if model_name:
        recipe_model = data.get("model", {})
        data["model"] = _deep_merge(load_model_dict(model_name), {k: v for k, v in recipe_model.items() if k != "name"})
        data["model"]["name"] = Path(model_name).stem
    data = _layout_defaults(data)
    data = apply_overrides(data, overrides or [])
    return build(RunConfig, data)


def _layout_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The model config's `layout` gives the parallel split and engine count unless the recipe sets them."""
    layout = data.get("model", {}).get("layout")
    if not layout:
        return data
    layout = build(ParallelLayout, layout, prefix="model.layout")
    parallel = {
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "etp": layout.etp,
        "sequence_parallel": layout.sequence_parallel,
        "trainer_devices": layout.trainer_gpus,
    }
    engine = {"tp": layout.generator_tp, "num_engines": max(1, layout.generator_gpus // layout.generator_tp)}
    trainer = {"recompute": {"granularity": layout.recompute}}
    data = _deep_merge({"parallel": parallel, "rollout": {"engine": engine}, "trainer": trainer}, data)
    return data


def save_config(config: RunConfig, path: Path) -> None:
    """Write the resolved config (every field, defaults included) so the run can be reproduced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def load_resolved(path: Path) -> RunConfig:
    """Read back a config written by `save_config`."""
    return build(RunConfig, _read_yaml(path))
