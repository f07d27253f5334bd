"""The trainer's sections: the parallel layout, recompute, performance switches, the optimizer and the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.errors import fail


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
                fail(name, f"must be >= 1, got {getattr(self, name)}")
        if self.etp is not None and self.etp < 1:
            fail("etp", f"must be >= 1 or null, got {self.etp}")
        if self.trainer_devices % (self.tp * self.cp * self.pp):
            layout = f"tp x pp = {self.tp} x {self.pp}"
            if self.cp > 1:
                layout = f"tp x cp x pp = {self.tp} x {self.cp} x {self.pp}"
            fail("trainer_devices", f"world size {self.trainer_devices} must be a multiple of {layout}")
        if self.sequence_parallel and self.tp == 1:
            fail("sequence_parallel", "needs tp > 1 (megatron-core: no sequence parallelism without TP)")

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
            fail("num_layers", f"must be >= 1, got {self.num_layers}")
        unknown = sorted(set(self.modules) - set(RECOMPUTE_MODULES))
        if unknown:
            fail("modules", f"{unknown} not among megatron-core's recompute modules {list(RECOMPUTE_MODULES)}")
        if self.granularity == "selective" and not self.modules:
            fail("modules", "selective recompute needs at least one module")


def check_norm_recompute(recompute: RecomputeConfig, te: bool) -> None:
    """megatron-core 0.19.2 recomputes norms (`layernorm` in selective recompute) only with Transformer Engine:
    its CheckpointWithoutOutput reads TE's FP8 state unconditionally. Checked at config for the layer spec the
    run's trainer will use (RunConfig.check_recompute) and again where the model is built (trainer/model.py)."""
    if recompute.granularity == "selective" and "layernorm" in recompute.modules and not te:
        fail(
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
            fail("lr", f"must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            fail("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            fail("adam_beta1", "adam_beta1 and adam_beta2 must be in [0, 1)")
        if self.grad_clip < 0:
            fail("grad_clip", f"must be >= 0, got {self.grad_clip}")
        if not 0.0 < self.offload_fraction <= 1.0:
            fail("offload_fraction", f"must be in (0, 1], got {self.offload_fraction}")


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
    starts from random weights (model.hf_path null); 0 = none. Its prompts are the training prompts past the
    first 256 of the shuffled order (validation takes from the front): runs with any `data.val_prompts` up to 256
    start from the same policy, and no validation prompt is trained on."""
    warm_start_slip: float = 0.0
    """(CPU demo) chance per step of a worked solution that the warm-up's copy carries a slip (a column sum
    off by one, carried into the answer; data/synthetic.py): the policy learns the method and an error rate,
    as a pretrained model does, and RL has errors to remove. 0 = every warm-up solution is correct."""
    warm_start_tool_share: float = 0.0
    """(CPU demo) share of the warm-up's solutions of a dataset that declares the `python` tool which call it
    (`print(a + b)`, its output boxed; the slip copies an operand wrong) instead of working by hand: the policy
    learns the call syntax and an error rate, and RL finds out when calling pays."""
    warm_start_tool_slip: float | None = None
    """(CPU demo) chance that a warm-up tool solution miscopies an operand into its call; None = `warm_start_slip`."""
    layer_spec: Literal["auto", "transformer_engine", "local"] = "auto"
    """auto = Transformer Engine when importable and CUDA is present, else megatron-core's local spec."""
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.warm_start_steps < 0:
            fail("warm_start_steps", f"must be >= 0, got {self.warm_start_steps}")
        if not 0.0 <= self.warm_start_slip < 1.0:
            fail("warm_start_slip", f"must be in [0, 1), got {self.warm_start_slip}")
        if self.warm_start_tool_slip is not None and not 0.0 <= self.warm_start_tool_slip < 1.0:
            fail("warm_start_tool_slip", f"must be in [0, 1), got {self.warm_start_tool_slip}")
        if not 0.0 <= self.warm_start_tool_share <= 1.0:
            fail("warm_start_tool_share", f"must be in [0, 1], got {self.warm_start_tool_share}")
