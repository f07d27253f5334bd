"""GPTModel from a megatron_rl model config: dense or MoE, Transformer Engine or local spec, FP32 LM head.

    model = build_model(run_config)      # after init_distributed(); one pipeline stage's chunk
    config = transformer_config(model_cfg, parallel_cfg, trainer_cfg)

The FP32 LM head (SCALERL.md §3): megatron-core has no switch for it, so the output layer (and the
embedding when they are tied) is cast to fp32 after construction while the body keeps the configured
dtype; the log-prob path (logprobs.py) casts the final hidden states to fp32 before the projection.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl.config import ModelConfig, ParallelConfig, TrainerConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def use_transformer_engine(trainer: TrainerConfig) -> bool:
    """Whether to build with Transformer Engine's layer spec (`trainer.layer_spec`)."""
    if trainer.layer_spec == "local":
        return False
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


def transformer_config(model: ModelConfig, parallel: ParallelConfig, trainer: TrainerConfig) -> Any:
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[trainer.params_dtype]
    cuda = torch.cuda.is_available()
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
            moe_grouped_gemm=False,
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
        expert_model_parallel_size=parallel.ep,
        sequence_parallel=parallel.sequence_parallel,
        variable_seq_lengths=True,
        calculate_per_token_loss=True,
        use_cpu_initialization=not cuda,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=False,
        moe_token_dispatcher_type=dispatcher,
        **moe,
    )


def build_model(model: ModelConfig, parallel: ParallelConfig, trainer: TrainerConfig, initialize: bool = True) -> Any:
    """This rank's GPTModel chunk (not wrapped in DDP), on the current device, FP32 head applied.

    `initialize=False` leaves the weights uninitialised (for an import that overwrites every one of them).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_rl.trainer import cpu_compat

    config = transformer_config(model, parallel, trainer)
    config.perform_initialization = initialize
    te = use_transformer_engine(trainer)
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization="RMSNorm", qk_l2_norm=model.qk_l2_norm
    )
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
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    dtype = DTYPES[trainer.params_dtype]
    for param in gpt.parameters():  # megatron's torch norms are created fp32; buffers (RoPE) stay fp32
        param.data = param.data.to(dtype)
    if trainer.fp32_lm_head:
        cast_lm_head_to_fp32(gpt)
    cpu_compat.apply()  # covers megatron modules imported while building
    return gpt


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


def cast_lm_head_to_fp32(gpt: Any) -> None:
    """Output layer in fp32 (and the word embedding when it shares the output weight)."""
    if gpt.post_process and not gpt.share_embeddings_and_output_weights:
        gpt.output_layer.float()
    if gpt.share_embeddings_and_output_weights and (gpt.pre_process or gpt.post_process):
        weight = gpt.shared_embedding_or_output_weight()
        weight.data = weight.data.float()


def output_weight(gpt: Any) -> torch.Tensor:
    """The (vocab-parallel) LM-head weight [vocab / tp, hidden] on the last pipeline stage."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
