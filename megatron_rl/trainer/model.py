"""GPTModel from a megatron_rl model config: dense or MoE, Transformer Engine or local spec, FP32 LM head.

    model = build_model(run_config)      # after init_distributed(); one pipeline stage's chunk
    config = transformer_config(model_cfg, parallel_cfg, trainer_cfg)

The one place where the GPU and CPU paths differ: the layer spec. Transformer Engine's on CUDA (its
attention reads packed rows' `cu_seqlens`, its norms and linears fuse), megatron-core's local spec otherwise,
with its core attention replaced by `trainer/attention.py::PackedCoreAttention` (packed rows, no mask) and its
norms by `SequenceParallelRMSNorm` (sequence parallel on CPU too). Llama-4's chunk/temperature rules wrap
either attention. Everything else (packing, process groups, padding, recompute) is shared.

The FP32 LM head (docs/recipe.md §3): megatron-core has no switch for it, so the output layer (and the
embedding when they are tied) is cast to fp32 after construction while the body keeps the configured
dtype; the log-prob path (logprobs.py) casts the final hidden states to fp32 before the projection.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl.config import (
    GPU_IMAGE_HAS_APEX,
    ModelConfig,
    ParallelConfig,
    RecomputeConfig,
    TrainerConfig,
    check_norm_recompute,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def use_transformer_engine(trainer: TrainerConfig) -> bool:
    """Whether to build with Transformer Engine's layer spec (`trainer.layer_spec`)."""
    if trainer.layer_spec == "local":
        return False
    if _standin():  # this process builds what a GPU node builds (te_standin.install())
        return True
    broken = transformer_engine_import_error()
    if broken is not None and torch.cuda.is_available():
        # Installed on a GPU node but its torch binding does not import: megatron-core catches that import error,
        # builds Transformer Engine's layer spec from stand-ins and fails with a bare TypeError at the first layer.
        # Falling back to the local spec would change the run's kernels and memory from what was planned.
        raise RuntimeError(
            f"Transformer Engine is installed but does not import ({broken}): the GPU image's build is broken "
            "(rebuild it, env/megatron_rl.def or env/Dockerfile), or set trainer.layer_spec=local"
        )
    try:
        import transformer_engine  # noqa: F401

        available = torch.cuda.is_available()
    except Exception:  # the TE meta-package raises at import without a CUDA build
        available = False
    if trainer.layer_spec == "transformer_engine" and not available:
        raise RuntimeError(
            "trainer.layer_spec: transformer_engine requested but Transformer Engine with CUDA is not "
            "available; use trainer.layer_spec=local or auto"
        )
    return available


def transformer_engine_import_error() -> str | None:
    """Why Transformer Engine's torch binding, as megatron-core imports it, fails to import where the package is
    installed (`ImportError: ... undefined symbol ...` of a binding built against another torch or CUDA); None when
    it imports or is not installed."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # noqa: F401
    except Exception as exc:  # ImportError, OSError of a missing .so, RuntimeError of the meta-package
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return None


def _standin() -> bool:
    from megatron_rl.trainer import te_standin

    return te_standin.active()


def apex_wgrad_kernel() -> bool:
    """Whether NVIDIA Apex's `fused_weight_gradient_mlp_cuda` imports here (megatron's gradient-accumulation
    fusion in its own linear layers needs it; Transformer Engine's linears do not)."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def performance_settings(trainer: TrainerConfig, te: bool | None = None, apex: bool | None = None) -> dict[str, bool]:
    """`trainer.performance`, each null resolved: on with Transformer Engine on CUDA, off otherwise; the
    gradient-accumulation fusion only where Apex's kernel is there as well. `te` and `apex` override what this host
    offers (the cluster's resolution, for the plan and the checks)."""
    te = use_transformer_engine(trainer) if te is None else te
    apex = apex_wgrad_kernel() if apex is None else apex
    resolved = {name: te if value is None else value for name, value in dataclasses.asdict(trainer.performance).items()}
    if trainer.performance.gradient_accumulation_fusion is None:
        resolved["gradient_accumulation_fusion"] = te and apex
    return resolved


def cluster_transformer_engine(trainer: TrainerConfig) -> bool:
    """Whether a GPU node of the cluster builds with Transformer Engine (`trainer.layer_spec`), whatever this
    host has: the memory plan runs before launch, on a login node or a GPU node alike. The GPU image
    installs Transformer Engine, so `auto` means it."""
    return trainer.layer_spec != "local"


def cluster_performance_settings(trainer: TrainerConfig) -> dict[str, bool]:
    """The kernel switches as a GPU node of the cluster resolves them, with the image's Transformer Engine and
    Apex (config.GPU_IMAGE_HAS_APEX), whatever this host has."""
    return performance_settings(trainer, cluster_transformer_engine(trainer), GPU_IMAGE_HAS_APEX)


def meta_performance_settings(trainer: TrainerConfig) -> dict[str, bool]:
    """The kernel switches of a meta-device build for the memory plan: grouped GEMM as the cluster resolves it
    (megatron-core validates recompute against it), every fusion off. The fusions change no parameter, and
    megatron-core refuses them where their kernels (Transformer Engine, Apex) are not installed."""
    perf = cluster_performance_settings(trainer)
    return {name: value if name == "moe_grouped_gemm" else False for name, value in perf.items()}


def recompute_settings(recompute: RecomputeConfig, te: bool) -> dict[str, Any]:
    """`trainer.recompute` as megatron-core's TransformerConfig fields."""
    check_norm_recompute(recompute, te)  # at config already, for the spec the run's nodes use; here for this host's
    if recompute.granularity == "none":
        return dict(recompute_granularity=None)
    if recompute.granularity == "selective":
        return dict(recompute_granularity="selective", recompute_modules=list(recompute.modules))
    return dict(
        recompute_granularity="full", recompute_method=recompute.method, recompute_num_layers=recompute.num_layers
    )


def transformer_config(model: ModelConfig, parallel: ParallelConfig, trainer: TrainerConfig, meta: bool = False) -> Any:
    """megatron-core's TransformerConfig for this run; `meta`: for a meta-device build (see `build_model`)."""
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[trainer.params_dtype]
    # CPU initialisation creates parameters on the ambient device (the meta device for the plan); without it
    # megatron-core allocates each one on torch.cuda.current_device().
    cpu_init = meta or not torch.cuda.is_available()
    te = cluster_transformer_engine(trainer) if meta else use_transformer_engine(trainer)
    if not meta:
        perf = performance_settings(trainer)
    elif _standin():  # the GPU build check: the cluster's own switches (megatron validates them at construction)
        perf = cluster_performance_settings(trainer)
    else:
        perf = meta_performance_settings(trainer)
    dispatcher = model.moe.token_dispatcher
    moe: dict[str, Any] = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.moe.num_experts,
            moe_router_topk=model.moe.router_topk,
            moe_ffn_hidden_size=model.moe.ffn_hidden_size or model.ffn_hidden_size,
            moe_shared_expert_intermediate_size=model.moe.shared_expert_ffn_hidden_size,
            moe_router_score_function=model.moe.router_score_function,
            moe_router_pre_softmax=model.moe.router_pre_softmax,
            moe_apply_probs_on_input=model.moe.apply_probs_on_input,
            moe_aux_loss_coeff=model.moe.aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if model.moe.aux_loss_coeff > 0 else "none",
            # HF (Qwen3-MoE decoder_sparse_step, Llama-4 interleave_moe_layer_step): layer i is MoE when
            # (i + 1) % N == 0; megatron's integer form would make it i % N == 0.
            moe_layer_freq=[int((i + 1) % model.moe.layer_freq == 0) for i in range(model.num_layers)],
            moe_grouped_gemm=perf["moe_grouped_gemm"],
            moe_permute_fusion=perf["moe_permute_fusion"],
            moe_router_dtype="fp32",
        )
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        activation_func=F.silu,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        qk_layernorm=model.qk_layernorm,
        qk_l2_norm=model.qk_l2_norm,
        no_rope_freq=model.no_rope_freq,
        rotary_interleaved=model.family == "llama4",  # Llama-4 rotates adjacent pairs (HF's complex RoPE)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        cp_comm_type="p2p",  # Transformer Engine's ring exchange, the one its THD layout supports
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp(model.is_moe),
        sequence_parallel=parallel.sequence_parallel,
        variable_seq_lengths=True,
        calculate_per_token_loss=True,
        use_cpu_initialization=cpu_init,
        gradient_accumulation_fusion=perf["gradient_accumulation_fusion"],
        bias_activation_fusion=perf["bias_activation_fusion"],
        bias_dropout_fusion=perf["bias_dropout_fusion"],
        masked_softmax_fusion=perf["masked_softmax_fusion"],
        apply_rope_fusion=perf["apply_rope_fusion"],
        persist_layer_norm=False,
        deallocate_pipeline_outputs=False,
        moe_token_dispatcher_type=dispatcher,
        **recompute_settings(trainer.recompute, te),
        **moe,
    )


def build_model(
    model: ModelConfig, parallel: ParallelConfig, trainer: TrainerConfig, initialize: bool = True, meta: bool = False
) -> Any:
    """This rank's GPTModel chunk (not wrapped in DDP), on the current device, FP32 head applied.

    `initialize=False` leaves the weights uninitialised (for an import that overwrites every one of them).
    `meta=True` builds for the memory plan, on a host with or without CUDA: parameters on the ambient device
    (call it under `torch.device("meta")`), never moved to CUDA, and megatron-core's validation run with the
    cluster's settings (`cluster_transformer_engine`) rather than this host's.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_rl.trainer import cpu_compat

    config = transformer_config(model, parallel, trainer, meta=meta)
    config.perform_initialization = initialize
    # The plan builds the local spec where the cluster runs Transformer Engine's (TE's modules allocate on an
    # explicit device, never the meta device), unless the TE stand-in is installed (trainer/te_standin.py, the
    # GPU build check): then TE's spec with the cluster's switches. Parameter counts are identical (TE fuses
    # each norm's weight into the following linear layer; its grouped experts hold the same per-expert
    # weights as megatron's SequentialMLP), which the GPU build check verifies.
    te = (cluster_transformer_engine(trainer) and _standin()) if meta else use_transformer_engine(trainer)
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization="RMSNorm", qk_l2_norm=model.qk_l2_norm
    )
    _packed_attention_spec(spec, model, te)
    rope_scaling = model.rope_scaling_factor is not None
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model.rotary_base),
        rope_scaling=rope_scaling,
        rope_scaling_factor=model.rope_scaling_factor or 8.0,
    )
    if rope_scaling:
        _set_rope_scaling(gpt, model)
    if model.qk_l2_norm and model.no_rope_freq:
        for layer in gpt.decoder.layers:  # HF Llama-4 L2-normalises q/k on RoPE layers only; megatron on all
            if config.no_rope_freq[layer.layer_number - 1]:
                layer.self_attention.q_layernorm = layer.self_attention.k_layernorm = None
    if torch.cuda.is_available() and not meta:
        gpt.cuda(torch.cuda.current_device())
    dtype = DTYPES[trainer.params_dtype]
    for param in gpt.parameters():  # megatron's torch norms are created fp32; buffers (RoPE) stay fp32
        param.data = param.data.to(dtype)
    if trainer.fp32_lm_head:
        cast_lm_head_to_fp32(gpt, dtype)
    cpu_compat.apply()  # covers megatron modules imported while building
    return gpt


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm as megatron builds a norm (`config`, `hidden_size`, `eps`), usable under sequence
    parallel: the weight is marked `sequence_parallel`, so that `finalize_model_grads` sums its gradient over
    the TP group (each TP rank saw a slice of the sequence), as Transformer Engine's norms are marked.
    Numerically the same module as megatron's `WrappedTorchNorm`, which refuses sequence parallel."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _packed_attention_spec(block_spec: Any, model: ModelConfig, te: bool) -> None:
    """Packed sequences (THD) in the layer specs, and on the local spec norms that allow sequence parallel.

    Transformer Engine's attention reads `cu_seqlens` itself; Llama-4's chunk and temperature rules wrap it.
    The local spec's `DotProductAttention` refuses packed sequences: it is replaced by `PackedCoreAttention`.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron_rl.trainer.attention import PackedCoreAttention, te_packed_attention_class

    llama4 = model.attention_chunk_size is not None or model.attn_temperature_tuning
    core_attention: Any = None
    if not te:
        core_attention = functools.partial(_local_attention, PackedCoreAttention, model)
    elif llama4:
        core_attention = functools.partial(_local_attention, te_packed_attention_class(), model)

    def norm(module: Any) -> Any:
        return SequenceParallelRMSNorm if module is WrappedTorchNorm else module

    for layer_spec in block_spec.layer_specs:
        layer = layer_spec.submodules
        attention = layer.self_attention.submodules
        if core_attention is not None:
            attention.core_attention = core_attention
        layer.input_layernorm, layer.pre_mlp_layernorm = norm(layer.input_layernorm), norm(layer.pre_mlp_layernorm)
        attention.q_layernorm, attention.k_layernorm = norm(attention.q_layernorm), norm(attention.k_layernorm)
    block_spec.layer_norm = norm(block_spec.layer_norm)


def _local_attention(cls: type, model: ModelConfig, *args: Any, layer_number: int, **kwargs: Any) -> Any:
    """Build core attention `cls` for megatron layer `layer_number` (1-based, global) with its Llama-4 rule."""
    from megatron_rl.trainer.attention import Llama4Attention

    return cls(*args, layer_number=layer_number, llama4=Llama4Attention.for_layer(model, layer_number), **kwargs)


def _set_rope_scaling(gpt: Any, model: ModelConfig) -> None:
    """Llama-3-style RoPE scaling with the configured factors (megatron hard-codes low 1, high 4, 8192)."""
    rope = gpt.rotary_pos_emb
    dim = model.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim
    rope.inv_freq = rope._apply_scaling(
        1.0 / (model.rotary_base**exponents),
        factor=model.rope_scaling_factor,
        low_freq_factor=model.rope_low_freq_factor,
        high_freq_factor=model.rope_high_freq_factor,
        original_max_position_embeddings=model.rope_original_max_position,
    )


def cast_lm_head_to_fp32(gpt: Any, body_dtype: torch.dtype) -> None:
    """Output layer in fp32 (and the word embedding when it shares the output weight).

    A shared weight in fp32 makes the embedding lookup fp32 too; its output is cast back to the body's dtype,
    or the first bf16 GEMM of the first layer refuses it (torch: "expected m1 and m2 to have the same dtype";
    Transformer Engine raises a TypeError). Its gradient flows back to the fp32 weight through the cast."""
    if gpt.post_process and not gpt.share_embeddings_and_output_weights:
        gpt.output_layer.float()
    if gpt.share_embeddings_and_output_weights and (gpt.pre_process or gpt.post_process):
        weight = gpt.shared_embedding_or_output_weight()
        weight.data = weight.data.float()
        if gpt.pre_process and body_dtype != torch.float32:
            gpt.embedding.register_forward_hook(lambda module, args, output: output.to(body_dtype))


def output_weight(gpt: Any) -> torch.Tensor:
    """The (vocab-parallel) LM-head weight [vocab / tp, hidden] on the last pipeline stage."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
