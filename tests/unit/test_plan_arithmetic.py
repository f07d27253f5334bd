"""The memory plan's arithmetic against independent formulas: Korthikanti et al. 2022 for activations,
Megatron-LM's theoretical memory accounting (selective recompute; 6 + 12/dp bytes per parameter)."""

from __future__ import annotations

import pytest

from megatron_rl.plan import LayerShape, layer_activation_bytes

S, H, A = 4096, 4096, 32


def _gpt3(**kwargs) -> LayerShape:
    """The paper's GPT layer: MHA, a 4h GELU MLP, dropout, attention scores materialised."""
    return LayerShape(H, A, A, H // A, 4 * H, gated=False, flash=False, dropout=True, **kwargs)


def test_activations_equal_korthikanti_without_parallelism():
    # Korthikanti et al. 2022, Eq. 1: sbh (34 + 5 a s / h) bytes per layer (b = 1).
    assert layer_activation_bytes(_gpt3(), S) == S * H * 34 + 5 * A * S * S


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_activations_equal_korthikanti_with_tensor_and_sequence_parallel(tp):
    # Eq. 2, tensor parallel only: sbh (10 + 24/t + 5 a s / (h t)); Eq. 4, with sequence parallel: sbh/t (34 + 5as/h).
    tensor = layer_activation_bytes(_gpt3(), S, tp=tp, sp=False)
    assert tensor == pytest.approx(S * H * (10 + 24 / tp + 5 * A * S / (H * tp)), rel=1e-12)
    both = layer_activation_bytes(_gpt3(), S, tp=tp, sp=True)
    assert both == pytest.approx(S * H / tp * (34 + 5 * A * S / H), rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_selective_recompute_equals_megatron_lm_theoretical_activation_memory(tp):
    # Megatron-LM's theoretical_memory_usage (selective recompute of core attention, sequence parallel):
    # s b h (18 + 4 ffn / h) / t per layer.
    got = layer_activation_bytes(_gpt3(), S, tp=tp, sp=tp > 1, recompute_modules=("core_attn",))
    assert got == pytest.approx(S * H * (18 + 4 * 4 * H / H) / tp, rel=1e-12)


def test_our_layers_swiglu_gqa_flash_no_dropout():
    """Llama-3-8B's layer at one rank of TP 2 + SP, counted by hand from what each op saves."""
    shape = LayerShape(4096, 32, 8, 128, 14336)
    s, t = 16384, 2
    by_hand = (
        2 * s * 4096 / t * 2  # attention norm input + QKV input (sequence-parallel shards)
        + 2 * s * (4096 + 2 * 1024) / t  # q, k, v
        + 2 * s * 4096 / t
        + 4 * s * 32 / t  # flash output (= projection input), fp32 log-sum-exp
        + 2 * s * 4096 / t * 2  # MLP norm input + fc1 input
        + 2 * s * 2 * 14336 / t
        + 2 * s * 14336 / t  # gate/up output (SwiGLU input), fc2 input
    )
    assert layer_activation_bytes(shape, s, tp=t, sp=True) == by_hand
    recomputed = layer_activation_bytes(shape, s, tp=t, sp=True, recompute_modules=("mlp", "layernorm"))
    assert by_hand - recomputed == 2 * s * 3 * 14336 / t + 2 * 2 * s * 4096 / t


def test_moe_layer_counts_routed_tokens_and_the_shared_expert():
    dense = LayerShape(1024, 8, 8, 128, 0)
    moe = LayerShape(1024, 8, 8, 128, 0, moe_experts=16, moe_topk=1, moe_ffn=2048, moe_shared_ffn=2048)
    s = 1000
    extra = layer_activation_bytes(moe, s) - layer_activation_bytes(dense, s)
    routed = s * 1 * 1.5  # EXPERT_LOAD_FACTOR
    expected = 8 * s * 16 + 2 * 2 * routed * 1024 + 2 * routed * 2048 * 3 + 2 * s * 2048 * 3
    assert extra == pytest.approx(expected)
    assert layer_activation_bytes(moe, s, recompute_modules=("moe", "shared_experts")) == pytest.approx(
        layer_activation_bytes(dense, s) + 8 * s * 16
    )


def test_sequences_in_flight_per_engine_follow_the_pipelines_capacity():
    from megatron_rl.config import load_config
    from megatron_rl.plan import in_flight_sequences

    # rollout/pipeline.py: capacity min(2, k) x prompts_per_step groups (pipeline), k x prompts_per_step (PPO).
    run = load_config("scalerl", "llama3_8b")  # pipeline, k 8, 48 prompts x 16, 64 engines
    assert in_flight_sequences(run) == 2 * 48 * 16 // 64 == 24
    assert in_flight_sequences(load_config("scalerl", "llama3_8b", ["rollout.k=1"])) == 12
    ppo = load_config("scalerl", "llama3_8b", ["rollout.mode=ppo_off_policy", "rollout.k=4"])
    assert in_flight_sequences(ppo) == 4 * 48 * 16 // 64 == 48
    uneven = load_config("scalerl", "llama3_8b", ["rollout.engine.num_engines=40"])
    assert in_flight_sequences(uneven) == 39  # 1,536 over 40 engines: the busiest holds the ceiling


def test_a_kv_pool_short_of_the_sequences_in_flight_is_a_warning_with_the_counts():
    from megatron_rl.config import load_config
    from megatron_rl.plan import GIB, EngineMemory, kv_warnings

    run = load_config("scalerl", "llama3_8b")
    per_sequence = 131072.0 * 16384  # Llama-3.1-8B: 2 (K, V) x 2 B x 32 layers x 8 KV heads x 128 = 128 KiB per token
    short = EngineMemory(15 * GIB, 131072.0, 8.5 * per_sequence, 16384, 24, context=16448)
    assert (short.pool_sequences, short.fitting) == (8, 8)
    (warning,) = kv_warnings(run, short)
    assert "the KV pool holds 8 of the 24 sequences in flight per engine at 16384 tokens each" in warning
    assert "(pipeline, k=8: 2 x 48 prompts x 16 generations over 64 engines); SGLang queues the rest" in warning
    roomy = EngineMemory(15 * GIB, 131072.0, 26 * per_sequence, 16384, 24, context=16448)
    assert kv_warnings(run, roomy) == [] and roomy.fitting == 24


def test_routing_records_cost_layers_times_topk_bytes_per_token():
    """Routing replay's records at the shipped MoE layouts, from the models' shapes: Qwen3-30B-A3B 48 layers x
    top-8, Scout 48 layers x top-1, one byte per choice (<= 256 experts)."""
    from megatron_rl.config import load_config
    from megatron_rl.plan import make_plan

    for model, per_token in (("qwen3_30b_a3b", 48 * 8), ("llama4_scout_17bx16e", 48 * 1)):
        run = load_config("scalerl", model, ["algo.routing_replay=rollout"])
        plan = make_plan(run)
        r = run.rollout
        assert plan.routing is not None and plan.routing.per_token == per_token
        assert plan.routing.batch == per_token * r.prompts_per_step * r.generations_per_prompt * r.context_length
        assert plan.engine is not None
        pool_tokens = int(plan.engine.pool // plan.engine.kv_per_token)
        assert plan.routing.engine_host == 4 * pool_tokens * per_token
    assert make_plan(load_config("scalerl", "qwen3_30b_a3b", [])).routing is None


def _llama3_8b_layer_by_hand(s: float, t: int) -> float:
    """Llama-3-8B's layer at TP t + SP, `s` tokens on the rank, from what each op saves (as above)."""
    return (
        2 * s * 4096 / t * 2
        + 2 * s * (4096 + 2 * 1024) / t
        + 2 * s * 4096 / t
        + 4 * s * 32 / t
        + 2 * s * 4096 / t * 2
        + 2 * s * 2 * 14336 / t
        + 2 * s * 14336 / t
    )


@pytest.mark.parametrize(("row", "cp"), [(32896, 2), (65664, 4)])
def test_context_parallel_ranks_hold_their_share_of_the_row(row, cp):
    """The paper's 32k axis and 64k: a CP rank saves what a rank without CP saves for row / cp tokens."""
    shape = LayerShape(4096, 32, 8, 128, 14336)
    got = layer_activation_bytes(shape, row / cp, tp=2, sp=True, cp=cp)
    assert got == pytest.approx(_llama3_8b_layer_by_hand(row / cp, 2), rel=1e-12)


def test_chunked_layers_under_context_parallel_keep_the_gathered_row():
    """Scout's chunked (RoPE) layers all-gather keys and values over the CP group and keep the whole row's for the
    backward: 2 tensors x 2 B x row x 8 query groups x 128 / TP, unless core attention is recomputed."""
    scout = LayerShape(5120, 40, 8, 128, 16384, chunked=True)
    row, cp, tp = 65664, 4, 4
    plain = layer_activation_bytes(scout, row / cp, tp=tp, sp=True, cp=1)
    assert layer_activation_bytes(scout, row / cp, tp=tp, sp=True, cp=cp) - plain == 2 * 2 * row * 8 * 128 / tp
    recomputed = layer_activation_bytes(scout, row / cp, tp=tp, sp=True, cp=cp, recompute_modules=("core_attn",))
    assert recomputed == layer_activation_bytes(scout, row / cp, tp=tp, sp=True, recompute_modules=("core_attn",))


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_optimizer_offload_moves_its_share_of_the_adam_state_to_the_host(fraction):
    """Device: 12 B per parameter of the rank's optimizer shard (fp32 copy, m, v) for what stays; host: 16 B per
    offloaded parameter (HybridDeviceOptimizer: fp32 copy, fp32 gradient buffer, m, v). Shards: dense parameters
    over DP x CP, expert parameters over expert DP (megatron-core's distributed optimizer)."""
    from megatron_rl.config import load_config
    from megatron_rl.plan import PushMemory, StageParameters, rank_memory

    overrides = [
        "parallel.cp=2",
        "trainer.optimizer.cpu_offload=true",
        f"trainer.optimizer.offload_fraction={fraction}",
    ]
    run = load_config("scalerl", "llama4_scout_17bx16e", overrides)  # 64 GPUs: TP 4 x CP 2 x DP 8, EP 16 x EDP 4
    params = StageParameters(dense=2_000_000_000, expert=6_000_000_000, fp32=0, vocab_per_rank=0, last=False)
    memory = rank_memory(run, 0, params, PushMemory(0.0, "", 0.0, 0.0, 0.0))
    shard = 2e9 / (8 * 2) + 6e9 / 4
    assert memory.optimizer == pytest.approx(12 * shard * (1 - fraction))
    assert memory.optimizer_host == pytest.approx(16 * shard * fraction)


def test_each_rank_counts_the_nccl_communicators_it_uses(monkeypatch):
    """One communicator per process group of more than one rank that a rank runs collectives in (NCCL creates it at
    the group's first use), NVLink SHARP's buffers on top when a site turns it on."""
    from megatron_rl.config import load_config
    from megatron_rl.plan import GIB, NCCL_COMMUNICATOR_GIB, NVLS_GIB, nccl_bytes, nccl_communicators

    scout = load_config("scalerl", "llama4_scout_17bx16e")  # TP 4, DP 16, EP 16, expert DP 4 (etp 1)
    assert nccl_communicators(scout, 0) == ["tp", "dp", "world", "ep", "expert_dp", "weight-push"]
    dense_pp = load_config("scalerl", "llama3_8b", ["parallel.pp=2", "parallel.trainer_devices=16"])
    assert nccl_communicators(dense_pp, 0) == ["tp", "dp", "model-parallel", "world", "pp-next", "weight-push"]
    assert nccl_communicators(dense_pp, 1) == ["tp", "dp", "model-parallel", "world", "pp-previous"]
    one = load_config(
        "scalerl", "llama3_8b", ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.trainer_devices=1"]
    )
    assert nccl_communicators(one, 0) == ["weight-push"]
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    assert nccl_bytes(scout, 0) == 6 * NCCL_COMMUNICATOR_GIB * GIB
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert nccl_bytes(scout, 0) == 6 * (NCCL_COMMUNICATOR_GIB + NVLS_GIB) * GIB
