"""The memory plan of a run: what each trainer rank and each engine holds, against the device, before launch.

    plan = make_plan(run)          # run: a RunConfig; builds the real model on the meta device per pipeline stage
    print(format_plan(plan))       # the table; plan.fits, plan.problems, plan.suggestions

Trainer rank (one row per pipeline stage: the TP/EP/DP ranks of a stage hold the same amounts). Parameter
counts are exact: megatron's own GPTModel is built on the meta device while this process acts as the stage's
first rank of the full world under torch's fake process-group backend, so every TP/EP shard is megatron's.

    weights      params_dtype bytes per local parameter (4 for the fp32 LM head)
    gradients    4 B per local parameter (megatron's fp32 main_grad buffers: grad_reduce_in_fp32)
    optimizer    fp32 main parameters (bf16 runs) + Adam m and v: 12 B per parameter (8 for fp32 runs), divided
                 by DP for dense parameters and by expert-DP for expert parameters with the distributed
                 optimizer (megatron-LM's theoretical count: 6 + 12/dp bytes per parameter for bf16)
    optimizer    with `trainer.optimizer.cpu_offload`, `offload_fraction` of it moves to the host, 16 B per
                 offloaded parameter there (megatron's HybridDeviceOptimizer: fp32 copy, fp32 gradient copy,
                 Adam m and v), counted per node against `compute.host_memory_gib`
    activations  tensors saved for backward of the longest row (`trainer.micro_batch_tokens` tokens, 1/cp of them
                 per rank under context parallelism), per layer by `layer_activation_bytes`, times the layers
                 holding them under `trainer.recompute`, times the micro-batches in flight (1F1B: pp on the first
                 stage); under CP, Llama-4's chunked layers also keep the whole row's gathered keys and values
    backward     the gradients the backward of one layer holds beside what it saved (its MLP's intermediates:
                 fc1 output and activation), for the layer where they are largest
    log-probs    the fp32 head path: fp32 hidden states of the row and their gradient, the logits chunks, and the
                 head's fp32 weight gradient that the chunked backward accumulates (trainer/logprobs.py)
    nccl         one NCCL communicator per process group of more than one rank that the rank communicates in
                 (`nccl_communicators`: TP, CP, pipeline neighbours, data-parallel, EP, expert TP and DP, the model-
                 parallel group of the gradient norm, the world, and on rank 0 the weight push's group), each
                 NCCL_COMMUNICATOR_GIB, plus NVLS_GIB each when NVLink SHARP is on (trainer ranks turn it off)
    reserve      CUDA context and allocator fragmentation: RESERVE_GIB (ours)

Engine: bf16 weights at the engine's TP, plus the KV pool SGLang carves out of `mem_fraction` of the device;
the plan requires room for at least one longest sequence, reports how many of the sequences the pipeline keeps
in flight per engine (`in_flight_sequences`) the pool holds at their longest, and warns when that is fewer than
all of them (SGLang queues the rest: slower rollouts, not a failure).

The activation count is the bookkeeping of Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", Sec. 4) with switches for what these models do differently: gated MLPs (SwiGLU),
grouped-query attention, flash attention (no s x s scores), no dropout, MoE. With the paper's settings (GELU,
MHA, 4h MLP, dropout, unfused attention) it gives their 34sbh + 5as^2b per layer exactly
(tests/unit/test_plan_arithmetic.py). MoE layers assume balanced routing times EXPERT_LOAD_FACTOR (ours): dropless
routing lets a rank receive more than its share.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from megatron_rl.config import ConfigError, ModelConfig, RunConfig, apply_overrides, build, to_dict

GIB = float(1 << 30)
RESERVE_GIB = 1.5
"""(ours) CUDA context with the kernels loaded (~0.5-1 GiB) and allocator fragmentation (expandable segments on)."""
NCCL_COMMUNICATOR_GIB = 0.5
"""(ours) Device memory of one NCCL communicator without NVLink SHARP: its channels' buffers of each protocol,
linear in the channels and flat in the ranks beyond two nodes (NVIDIA/nccl#986); measured 544-688 MB per group of
2-4 A100s on NVLink (NVIDIA/nccl#964). NCCL creates it at the group's first collective."""
NVLS_GIB = 1.0
"""(ours) What NVLink SHARP adds to each communicator when on (one H100 communicator took 1.6 GB with it,
NVIDIA/nccl#864). Trainer ranks start with NCCL_NVLS_ENABLE=0 unless the environment sets it, as NeMo's launcher
and SGLang do, since a run this close to the device's size cannot spare it."""
EXPERT_LOAD_FACTOR = 1.5
"""(ours) Tokens an expert-parallel rank processes relative to a perfectly balanced share (dropless routing)."""
HOST_OPTIMIZER_BYTES = 16.0
"""Host bytes per offloaded parameter in megatron-core's HybridDeviceOptimizer: its fp32 copy, the fp32 gradient
buffer it copies into, and Adam's two fp32 moments."""
GPUS_PER_NODE = 8
"""GPUs per node when the plan is not given an allocation (`--allocation NxG` gives G)."""
ENGINE_RESERVE_GIB = 4.0
"""(ours) What an SGLang engine needs outside its static pool: CUDA graphs, sampling buffers, activations."""


# --------------------------------------------------------------------------------------------------
# Activations (pure arithmetic)


@dataclass(frozen=True)
class LayerShape:
    """What one transformer layer saves for backward depends on (per micro-batch of `tokens`, batch 1)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool = True
    flash: bool = True
    """Fused/flash attention: no [heads, s, s] scores are kept (TE's attention, torch's SDPA)."""
    dropout: bool = False
    moe_experts: int = 0
    """Routed experts (0 = a dense MLP)."""
    moe_topk: int = 1
    moe_ffn: int = 0
    moe_shared_ffn: int = 0
    chunked: bool = False
    """Llama-4 chunked local attention: under context parallelism its keys and values are all-gathered over the CP
    group (trainer/context_parallel.py), and the gathered row is kept for the backward."""


def layer_activation_bytes(
    shape: LayerShape,
    tokens: float,
    tp: int = 1,
    sp: bool = False,
    etp: int = 1,
    recompute_modules: tuple = (),
    cp: int = 1,
) -> float:
    """Bytes saved for backward by one layer on one rank (bf16 activations, fp32 router and softmax stats).

    `tokens` are the rank's: a row's tokens / cp under context parallelism. Sequence parallel divides what lives
    outside the TP region (norm inputs, the inputs of the first linear layers, dropout masks) by tp; tensors
    inside it (q, k, v, attention output, MLP intermediates) are /tp either way. `recompute_modules` (selective
    recompute) drops what megatron recomputes instead of saving.
    """
    s, h, b = float(tokens), float(shape.hidden), 2.0
    outside = tp if sp else 1
    q_width, kv_width = shape.heads * shape.head_dim / tp, shape.kv_heads * shape.head_dim / tp
    saved = 0.0
    # Attention block: norm input, QKV input (the norm's output), q, k, v, attention output (= proj input).
    saved += b * s * h / outside * (1 if "layernorm" in recompute_modules else 2)
    saved += b * s * (q_width + 2 * kv_width)
    if shape.flash:
        saved += b * s * q_width + 4.0 * s * shape.heads / tp  # output + fp32 log-sum-exp per head
    else:
        scores = s * s * shape.heads / tp
        if "core_attn" not in recompute_modules:
            saved += b * scores + ((1.0 + b) * scores if shape.dropout else 0.0)  # softmax; dropout mask + output
        saved += b * s * q_width
    saved += (s * h / outside) if shape.dropout else 0.0
    if shape.chunked and cp > 1 and "core_attn" not in recompute_modules:
        saved += 2 * b * s * cp * kv_width  # the whole row's gathered keys and values
    # MLP block: norm input, fc1 input (the norm's output).
    saved += b * s * h / outside * (1 if "layernorm" in recompute_modules else 2)
    saved += (s * h / outside) if shape.dropout else 0.0
    if shape.moe_experts == 0:
        if "mlp" not in recompute_modules:
            saved += b * s * shape.ffn * (2 if shape.gated else 1) / tp + b * s * shape.ffn / tp
        return saved
    local = s / outside  # tokens this rank routes
    saved += 2 * 4.0 * local * shape.moe_experts  # fp32 router logits and probabilities
    if "moe" not in recompute_modules:
        routed = local * shape.moe_topk * EXPERT_LOAD_FACTOR * etp  # tokens this rank's expert shards process
        saved += 2 * b * routed * h  # permuted expert input, expert output before the weighted combine
        saved += b * routed * shape.moe_ffn * (2 if shape.gated else 1) / etp
        saved += 0.0 if "moe_act" in recompute_modules else b * routed * shape.moe_ffn / etp
    if shape.moe_shared_ffn and "shared_experts" not in recompute_modules:
        saved += b * s * shape.moe_shared_ffn * (2 if shape.gated else 1) / tp + b * s * shape.moe_shared_ffn / tp
    return saved


def layer_shapes(model: ModelConfig) -> list[LayerShape]:
    """One LayerShape per layer of `model` (MoE layers every `moe.layer_freq`)."""
    dense = LayerShape(model.hidden_size, model.num_attention_heads, model.num_query_groups, model.head_dim,
                       model.ffn_hidden_size)  # fmt: skip
    if model.attention_chunk_size is not None:  # HF: NoPE (unchunked) when (i + 1) % no_rope_freq == 0
        nope = model.no_rope_freq or 0
        chunked = [not (nope and (i + 1) % nope == 0) for i in range(model.num_layers)]
        dense = [dataclasses.replace(dense, chunked=c) for c in chunked]
    else:
        dense = [dense] * model.num_layers
    if not model.is_moe:
        return dense
    assert model.moe.num_experts is not None
    moe = dict(
        moe_experts=model.moe.num_experts,
        moe_topk=model.moe.router_topk,
        moe_ffn=model.moe.ffn_hidden_size or model.ffn_hidden_size,
        moe_shared_ffn=model.moe.shared_expert_ffn_hidden_size or 0,
    )
    return [dataclasses.replace(d, **moe) if (i + 1) % model.moe.layer_freq == 0 else d for i, d in enumerate(dense)]


def stage_activation_bytes(run: RunConfig, stage: int) -> float:
    """Activations pipeline stage `stage` holds at its peak, for a row of `micro_batch_tokens` tokens."""
    p, rc = run.parallel, run.trainer.recompute
    per_stage = run.model.num_layers // p.pp
    shapes = layer_shapes(run.model)[stage * per_stage : (stage + 1) * per_stage]
    tokens = run.trainer.micro_batch_tokens / p.cp
    etp = p.expert_tp(run.model.is_moe)
    modules = tuple(rc.modules) if rc.granularity == "selective" else ()
    full = [layer_activation_bytes(s, tokens, p.tp, p.sequence_parallel, etp, modules, p.cp) for s in shapes]
    layer_input = 2.0 * tokens * run.model.hidden_size / (p.tp if p.sequence_parallel else 1)
    if rc.granularity != "full":
        held = sum(full)
    elif rc.method == "uniform":  # each group of num_layers keeps its input; backward rebuilds one group at a time
        groups = math.ceil(per_stage / rc.num_layers)
        held = groups * layer_input + max(sum(full[i : i + rc.num_layers]) for i in range(0, per_stage, rc.num_layers))
    else:  # block: the first num_layers layers keep only their input, the rest everything
        n = min(rc.num_layers, per_stage)
        held = n * layer_input + sum(full[n:]) + (max(full[:n]) if n else 0.0)
    in_flight = p.pp - stage  # 1F1B: stage i holds pp - i micro-batches' activations after the warm-up
    return held * in_flight + max(layer_backward_bytes(s, tokens, p.tp, etp) for s in shapes)


def layer_backward_bytes(shape: LayerShape, tokens: float, tp: int = 1, etp: int = 1) -> float:
    """Gradients one layer's backward holds at its peak beside the saved tensors: those of its MLP intermediates
    (fc1 output, gated, and the activation's output), bf16. The other gradients of a layer are [tokens, hidden]
    and smaller. Measured on one H200 (benchmarks/README.md, GPU smoke): without this term the plan fell short of
    the trainer's forward/backward peak."""
    s, b = float(tokens), 2.0
    width = (2 if shape.gated else 1) + 1
    dense = b * s * shape.ffn * width / tp if shape.moe_experts == 0 else 0.0
    routed = s * shape.moe_topk * EXPERT_LOAD_FACTOR * etp if shape.moe_experts else 0.0
    experts = b * routed * shape.moe_ffn * width / etp
    shared = b * s * shape.moe_shared_ffn * width / tp
    return max(dense, experts + shared)


def logprob_bytes(run: RunConfig, vocab_per_rank: int) -> float:
    """The fp32 head path on the last stage: gathered hidden states and their gradient, logits chunks, and the
    head's weight gradient, which the chunked backward accumulates in fp32 whatever the head's dtype."""
    tokens, h = run.trainer.micro_batch_tokens / run.parallel.cp, run.model.hidden_size
    chunk_tokens = max(1, (run.trainer.logprob_chunk_mib << 20) // (4 * vocab_per_rank))
    return 2 * 4.0 * tokens * h + 3 * 4.0 * chunk_tokens * vocab_per_rank + 4.0 * vocab_per_rank * h


@dataclass(frozen=True)
class PushMemory:
    """The transient bytes of one weight push (trainer/weights.py iter_hf_weights -> generator/weight_sync.py),
    from the model's canonical tensors and their push dtype. It comes between steps, when the step's activations
    are freed, so a trainer rank needs max(activations, push) on top of its steady state."""

    largest: float
    """The largest full tensor in the engines' dtype."""
    largest_name: str
    rank0: float
    """Trainer rank 0 (the sender): a bucket being filled while a tensor is gathered (its TP pieces and their
    concatenation), or a full bucket and its flat copy for the broadcast: 2 x (bucket + largest tensor)."""
    other: float
    """Other trainer ranks keep nothing: the gather of one tensor, pieces and concatenation."""
    engine: float
    """An engine receives one flat bucket at a time, outside its static pool."""


def push_memory(run: RunConfig) -> PushMemory:
    from megatron_rl.models import canonical_shapes

    m, t = run.model, run.trainer
    engine_bytes = {"bfloat16": 2, "float32": 4}.get(run.rollout.engine.dtype)
    body = 2 if t.params_dtype == "bf16" else 4

    def size(name: str, shape: tuple[int, ...]) -> float:
        head = name in ("output_layer.weight", "embedding.word_embeddings.weight") and t.fp32_lm_head
        return float(math.prod(shape) * (engine_bytes or (4 if head else body)))

    sizes = {name: size(name, shape) for name, shape in canonical_shapes(m).items()}
    name = max(sizes, key=sizes.__getitem__)
    largest = sizes[name]
    bucket = float(run.rollout.sync_bucket_mb << 20)
    return PushMemory(largest, name, 2 * (bucket + largest), 2 * largest, bucket + largest)


# --------------------------------------------------------------------------------------------------
# Parameters per rank (megatron's model on the meta device, as one rank of the full world)


@dataclass
class StageParameters:
    dense: int
    """Non-expert parameters on one rank of the stage (replicated over DP)."""
    expert: int
    """Expert parameters on one rank (replicated over expert-DP)."""
    fp32: int
    """Parameters kept in fp32 whatever params_dtype is (the fp32 LM head)."""
    vocab_per_rank: int
    last: bool


def stage_parameters(run: RunConfig, stage: int) -> StageParameters:
    """Exact parameter counts of pipeline stage `stage`'s first rank: megatron builds it on the meta device.

    The same on a host with CUDA (the Slurm bootstrap plans on a GPU node): the model is built in
    `build_model`'s meta mode and megatron-core's CUDA calls are redirected to the CPU, so planning allocates
    nothing on a GPU and creates no CUDA context. A layout megatron-core refuses is a ConfigError naming the
    field.
    """
    from megatron_rl.trainer import quiet_megatron

    quiet_megatron()  # before megatron-core's first import: it warns about TE, Apex and absl as it loads
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_rl.trainer.model import build_model, output_weight

    _megatron_on_cpu()
    p = run.parallel
    if dist.is_initialized():
        raise RuntimeError("megatron_rl.plan: needs a process without a process group (it forms fake ones)")
    first_rank = stage * (p.trainer_devices // p.pp)  # megatron's order tp-cp-ep-dp-pp: pp outermost
    dist.init_process_group("fake", store=FakeStore(), rank=first_rank, world_size=p.trainer_devices)
    try:
        with _megatron_refusal_as_config_error():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=p.tp,
                pipeline_model_parallel_size=p.pp,
                context_parallel_size=p.cp,
                expert_model_parallel_size=p.ep,
                expert_tensor_parallel_size=p.expert_tp(run.model.is_moe),
                create_gloo_process_groups=False,
            )
            with torch.device("meta"):
                model = build_model(run.model, p, run.trainer, initialize=False, meta=True)
        dense = expert = fp32 = 0
        for param in model.parameters():
            assert param.device.type == "meta", f"plan: parameter on {param.device}, not the meta device"
            if getattr(param, "allreduce", True):
                dense += param.numel()
            else:
                expert += param.numel()
            fp32 += param.numel() if param.dtype == torch.float32 and run.trainer.params_dtype != "fp32" else 0
        vocab = int(output_weight(model).shape[0]) if model.post_process else 0
        return StageParameters(dense, expert, fp32, vocab, bool(model.post_process))
    finally:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

        destroy_moe_metrics_tracker()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _megatron_on_cpu() -> None:
    """megatron-core's CUDA-only constructor calls (MoE dispatcher streams, router buffers) on the CPU, on a
    host with CUDA too. `cpu_compat.apply()` does nothing where CUDA is present, because a training process
    there must reach the GPU; a planning process must not: the plan runs before launch on the node that then
    hosts trainer ranks, and a CUDA context or stray allocation would take memory the plan counts as free.
    Only megatron-core's modules in this process are affected."""
    from unittest import mock

    import torch

    from megatron_rl.trainer import cpu_compat

    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        cpu_compat.apply()


MEGATRON_FIELDS = (
    ("recompute_modules", "trainer.recompute.modules"),
    ("recompute_num_layers", "trainer.recompute.num_layers"),
    ("recompute_method", "trainer.recompute.method"),
    ("recompute", "trainer.recompute.granularity"),
    ("moe_grouped_gemm", "trainer.performance.moe_grouped_gemm"),
    ("dispatcher", "model.moe.token_dispatcher"),
    ("expert_tensor_parallel", "parallel.etp"),
    ("expert_model_parallel", "parallel.ep"),
    ("tensor_model_parallel", "parallel.tp"),
    ("pipeline_model_parallel", "parallel.pp"),
    ("sequence_parallel", "parallel.sequence_parallel"),
    ("num_query_groups", "model.num_query_groups"),
    ("num_attention_heads", "model.num_attention_heads"),
    ("moe", "model.moe"),
)
"""megatron-core's TransformerConfig / parallel_state names in its error messages -> the field to change."""


@contextlib.contextmanager
def _megatron_refusal_as_config_error() -> Iterator[None]:
    """A configuration megatron-core refuses (its ValueError, or an assert in megatron-core's own code) becomes
    a ConfigError that names our field, so that `megatron-rl plan` exits 2 with one line, not a traceback."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, AssertionError) as exc:
        if isinstance(exc, AssertionError) and not _raised_in_megatron(exc):
            raise  # an invariant of our own code: a bug, not a configuration
        message = str(exc) or type(exc).__name__
        if message.startswith(("model.", "parallel.", "trainer.")):  # our own check in the build path
            raise ConfigError(message) from None
        name = next((ours for theirs, ours in MEGATRON_FIELDS if theirs in message), "parallel/model/trainer")
        raise ConfigError(f"{name}: megatron-core refuses this configuration: {message}") from None


def _raised_in_megatron(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and f"{os.sep}megatron{os.sep}core{os.sep}" in tb.tb_frame.f_code.co_filename


# --------------------------------------------------------------------------------------------------
# The plan


@dataclass
class RankMemory:
    stage: int
    dense_params: int
    expert_params: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logprobs: float
    push: float = 0.0
    """The weight push's transient on the stage's busiest rank (rank 0 on stage 0): between steps, so it
    competes with the step's activations and log-probs, not in addition to them."""
    nccl: float = 0.0
    """The NCCL communicators of the stage's busiest rank (`nccl_communicators`)."""
    reserve: float = RESERVE_GIB * GIB
    optimizer_host: float = 0.0
    """Optimizer state this rank keeps in host memory (`trainer.optimizer.cpu_offload`)."""

    @property
    def total(self) -> float:
        transient = max(self.activations + self.logprobs, self.push)
        return self.weights + self.gradients + self.optimizer + transient + self.nccl + self.reserve


@dataclass
class EngineMemory:
    weights: float
    kv_per_token: float
    pool: float
    """Bytes SGLang can give the KV cache: mem_fraction x device - weights."""
    longest: int
    in_flight: int
    """Sequences the rollout pipeline keeps in flight on one engine (`in_flight_sequences`)."""
    context: int
    """The engines' --context-length (`rollout.context_length`)."""

    @property
    def requests(self) -> int:
        """SGLang 0.5.23's request slots (kv_cache_configurator.resolve_max_num_reqs, no --max-running-requests):
        512 per context's worth of KV-pool tokens, clamped to [2048, 4096], at most half the pool's tokens."""
        tokens = int(max(self.pool, 0.0) // self.kv_per_token)
        return min(max(min(int(tokens / self.context * 512), 4096), 2048), tokens // 2)

    @property
    def request_table(self) -> float:
        """Bytes of SGLang's request-to-token table: an int32 row of `context` tokens per slot, plus a padding row
        (mem_cache/memory_pool.py ReqToTokenPool), allocated outside the static pool of mem_fraction."""
        return 4.0 * (self.requests + 1) * self.context

    @property
    def pool_sequences(self) -> int:
        """Longest sequences the KV pool holds at once."""
        return int(max(self.pool, 0.0) // (self.kv_per_token * self.longest))

    @property
    def fitting(self) -> int:
        """How many of the sequences in flight the pool holds at once, each at its longest."""
        return min(self.pool_sequences, self.in_flight)


def in_flight_sequences(run: RunConfig) -> int:
    """Sequences in flight on one engine at the pipeline's peak (rollout/pipeline.py: the producer starts a
    group only while fewer than its capacity are generating or waiting for the trainer): groups of
    generations_per_prompt, `rollout.groups_in_flight` of them (config/rollout.py); the balancer spreads them over the
    engines, the busiest gets the ceiling."""
    r = run.rollout
    return -(-r.groups_in_flight * r.generations_per_prompt // r.engine.num_engines)


@dataclass
class RoutingMemory:
    """Routing replay's records (algo.routing_replay, docs/recipe.md §9): what they cost where they live."""

    per_token: int
    """Bytes per token of a record as it travels (layers x top-k compact ids; rollout/types.py RoutingShape)."""
    batch: float
    """A step's records at most (every completion at its longest): sent by the driver to, and held by, each
    trainer rank on the host for the step."""
    engine_host: float
    """SGLang's host cache of records, int32 per KV-pool token (state_capturer/routed_experts.py)."""
    engine_device: float
    """SGLang's device buffer of one forward's records, int32 per token of a prefill chunk."""
    trainer_device: float
    """The trainer's transient per MoE layer: one row's targets and own top-k as int64 [local tokens, top-k]."""


def routing_memory(run: RunConfig, engine: EngineMemory | None) -> RoutingMemory | None:
    if run.algo.routing_replay == "none" or not run.model.is_moe:
        return None
    m, r = run.model, run.rollout
    topk = m.moe.router_topk
    per_token = m.num_layers * topk * (1 if (m.moe.num_experts or 0) <= 256 else 2)
    batch = float(per_token * r.prompts_per_step * r.generations_per_prompt * r.context_length)
    pool_tokens = int(max(engine.pool, 0.0) // engine.kv_per_token) if engine is not None else 0
    chunk = SGLANG_CHUNKED_PREFILL_TOKENS
    p = run.parallel
    local = run.trainer.micro_batch_tokens // p.cp // (p.tp if p.sequence_parallel else 1)
    return RoutingMemory(
        per_token=per_token,
        batch=batch,
        engine_host=4.0 * pool_tokens * m.num_layers * topk,
        engine_device=4.0 * chunk * m.num_layers * topk,
        trainer_device=2 * 8.0 * local * topk,
    )


SGLANG_CHUNKED_PREFILL_TOKENS = 8192
"""SGLang 0.5.23's default --chunked-prefill-size on a large GPU: the routed-experts capturer's device rows."""


@dataclass
class Plan:
    run: RunConfig
    device: float
    ranks: list[RankMemory]
    engine: EngineMemory | None
    push: PushMemory
    routing: RoutingMemory | None = None
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What runs but slower than planned (sequences SGLang queues for want of KV cache)."""
    gpus_per_node: int = GPUS_PER_NODE

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def node_ranks(self) -> int:
        """Trainer ranks sharing one node's host memory (ranks fill nodes in order)."""
        return min(self.run.parallel.trainer_devices, self.gpus_per_node)

    @property
    def host_per_node(self) -> float:
        """Host memory the trainer ranks of one node need beyond their processes: offloaded optimizer state and a
        step's routing records (each rank holds its own)."""
        records = self.routing.batch if self.routing is not None else 0.0
        return self.node_ranks * (max(r.optimizer_host for r in self.ranks) + records)


def nccl_communicators(run: RunConfig, stage: int) -> list[str]:
    """The process groups of more than one rank that the busiest rank of pipeline stage `stage` runs collectives in,
    each an NCCL communicator on a GPU (megatron-core's groups; torch creates one per group at its first use)."""
    p, moe = run.parallel, run.model.is_moe
    sizes = {
        "tp": p.tp,
        "cp": p.cp,
        "dp": p.dp * p.cp,  # the distributed optimizer's reduce-scatter and all-gather (CP ranks shard it too)
        "model-parallel": p.tp * p.pp if p.pp > 1 else 1,  # the gradient norm; with PP 1, TP's own ranks
        "world": p.trainer_devices,  # barriers and checks over every rank
    }
    if p.pp > 1:  # send/recv with each neighbour stage: one communicator per pair
        sizes["pp-previous"] = 2 if stage > 0 else 1
        sizes["pp-next"] = 2 if stage < p.pp - 1 else 1
        if run.model.tie_word_embeddings and stage in (0, p.pp - 1):
            sizes["embedding"] = 2
    if moe:
        sizes.update(ep=p.ep, etp=p.expert_tp(moe), expert_dp=p.expert_dp(moe))
    names = [name for name, size in sizes.items() if size > 1]
    if stage == 0 and run.rollout.weight_sync == "distributed":
        names.append("weight-push")  # rank 0 and every engine rank
    return names


def nccl_bytes(run: RunConfig, stage: int) -> float:
    nvls = os.environ.get("NCCL_NVLS_ENABLE", "0") not in ("0", "")
    return len(nccl_communicators(run, stage)) * (NCCL_COMMUNICATOR_GIB + (NVLS_GIB if nvls else 0.0)) * GIB


def rank_memory(run: RunConfig, stage: int, params: StageParameters, push: PushMemory) -> RankMemory:
    p, moe = run.parallel, run.model.is_moe
    body = 2.0 if run.trainer.params_dtype == "bf16" else 4.0
    local = params.dense + params.expert
    weights = body * (local - params.fp32) + 4.0 * params.fp32
    main_and_adam = 12.0 if run.trainer.params_dtype == "bf16" else 8.0
    # the distributed optimizer shards over the data-parallel ranks, context-parallel ones included
    shard = params.dense / (p.dp * p.cp) + params.expert / p.expert_dp(moe) if p.distributed_optimizer else local
    opt = run.trainer.optimizer
    offloaded = opt.offload_fraction if opt.cpu_offload else 0.0
    return RankMemory(
        stage=stage,
        dense_params=params.dense,
        expert_params=params.expert,
        weights=weights,
        gradients=4.0 * local,
        optimizer=main_and_adam * shard * (1.0 - offloaded),
        optimizer_host=HOST_OPTIMIZER_BYTES * shard * offloaded,
        activations=stage_activation_bytes(run, stage),
        logprobs=logprob_bytes(run, params.vocab_per_rank) if params.last else 0.0,
        push=push.rank0 if stage == 0 else push.other,
        nccl=nccl_bytes(run, stage) if run.compute.device_kind == "gpu" else 0.0,
    )


def engine_memory(run: RunConfig, total_params: int, device: float) -> EngineMemory | None:
    engine, m = run.rollout.engine, run.model
    if engine.device != "cuda":
        return None
    weights = 2.0 * total_params / engine.tp
    kv_heads = max(1, m.num_query_groups // engine.tp)  # SGLang replicates KV heads when tp > groups
    kv_per_token = 2 * 2.0 * m.num_layers * kv_heads * m.head_dim
    r = run.rollout
    longest = r.max_prompt_tokens + r.interruption.max_thinking_tokens + r.answer_tokens
    pool = engine.mem_fraction * device - weights
    return EngineMemory(weights, kv_per_token, pool, longest, in_flight_sequences(run), r.context_length)


def kv_warnings(run: RunConfig, engine: EngineMemory) -> list[str]:
    """A KV pool that holds fewer longest sequences than the pipeline keeps in flight is not a refusal: SGLang
    queues the rest and runs them as others finish, so rollouts take longer than the plan's concurrency."""
    if engine.pool_sequences >= engine.in_flight or engine.pool_sequences == 0:
        return []
    r = run.rollout
    return [
        f"engine: the KV pool holds {engine.pool_sequences} of the {engine.in_flight} sequences in flight per "
        f"engine at {engine.longest} tokens each ({r.mode}, k={r.k}: "
        f"{r.batches_in_flight} x {r.prompts_per_step} prompts x "
        f"{r.generations_per_prompt} generations over {r.engine.num_engines} engines); SGLang queues the rest. "
        "More room: rollout.engine.mem_fraction, rollout.engine.tp or rollout.engine.num_engines"
    ]


def make_plan(run: RunConfig, suggest: bool = True, gpus_per_node: int | None = None) -> Plan:
    """The memory plan of `run`; with `suggest`, the smallest layout changes that make a refused plan fit.
    `gpus_per_node`: the allocation's GPUs per node (GPUS_PER_NODE when not given), for host memory per node."""
    device = run.compute.device_memory_gib * GIB
    stages = [stage_parameters(run, s) for s in range(run.parallel.pp)]
    push = push_memory(run)
    ranks = [rank_memory(run, s, params, push) for s, params in enumerate(stages)]
    total_params = _total_parameters(run, stages)
    engine = engine_memory(run, total_params, device)
    plan = Plan(run, device, ranks, engine, push, routing_memory(run, engine))
    plan.gpus_per_node = gpus_per_node or GPUS_PER_NODE
    for rank in ranks:
        if rank.total > device:
            transient = (
                f"activations {rank.activations / GIB:.1f} + log-probs {rank.logprobs / GIB:.1f}"
                if rank.activations + rank.logprobs >= rank.push
                else f"weight push {rank.push / GIB:.1f} (largest tensor {push.largest_name}: "
                f"{push.largest / GIB:.1f} GiB; rollout.sync_bucket_mb={run.rollout.sync_bucket_mb})"
            )
            plan.problems.append(
                f"trainer stage {rank.stage}: {rank.total / GIB:.1f} GiB per GPU > {device / GIB:.1f} GiB "
                f"(weights {rank.weights / GIB:.1f} + gradients {rank.gradients / GIB:.1f} + optimizer "
                f"{rank.optimizer / GIB:.1f} + {transient} + NCCL {rank.nccl / GIB:.1f} + reserve "
                f"{rank.reserve / GIB:.1f})"
            )
    host = run.compute.host_memory_gib * GIB
    if plan.host_per_node > host:
        plan.problems.append(
            f"trainer host memory: {plan.host_per_node / GIB:.0f} GiB per node of {plan.node_ranks} trainer GPUs "
            f"(offloaded optimizer state {max(r.optimizer_host for r in ranks) / GIB:.1f} GiB per rank"
            + (f", routing records {plan.routing.batch / GIB:.1f} GiB per rank" if plan.routing else "")
            + f") > compute.host_memory_gib={run.compute.host_memory_gib:.0f}"
        )
    if engine is not None:
        need = engine.kv_per_token * engine.longest
        if engine.pool < need or engine.weights + ENGINE_RESERVE_GIB * GIB > device:
            plan.problems.append(
                f"engine (TP {run.rollout.engine.tp}): weights {engine.weights / GIB:.1f} GiB leave "
                f"{max(engine.pool, 0) / GIB:.1f} GiB of rollout.engine.mem_fraction={run.rollout.engine.mem_fraction} "
                f"x {device / GIB:.1f} GiB for the KV cache; one {engine.longest}-token sequence needs "
                f"{need / GIB:.2f} GiB"
            )
        outside = (1 - run.rollout.engine.mem_fraction) * device - ENGINE_RESERVE_GIB * GIB
        if engine.request_table + push.engine > outside:
            plan.problems.append(
                f"engine: SGLang's request table ({engine.requests + 1} slots x {engine.context} tokens x 4 B = "
                f"{engine.request_table / GIB:.1f} GiB) and a pushed bucket ({push.engine / GIB:.1f} GiB) do not "
                f"fit the {outside / GIB:.1f} GiB left outside rollout.engine.mem_fraction="
                f"{run.rollout.engine.mem_fraction} after the engine's {ENGINE_RESERVE_GIB:.0f} GiB reserve; lower "
                "rollout.engine.mem_fraction, rollout.sync_bucket_mb or rollout.context_length"
            )
        plan.warnings += kv_warnings(run, engine)
    if plan.problems and suggest:
        plan.suggestions = suggestions(run)
    return plan


def _total_parameters(run: RunConfig, stages: list[StageParameters]) -> int:
    """All parameters of the model, from the per-rank shards (for the engines' weights)."""
    p, moe = run.parallel, run.model.is_moe
    dense = sum(s.dense for s in stages) * p.tp  # TP shards (norms are replicated: a slight overcount)
    expert = sum(s.expert for s in stages) * p.ep * p.expert_tp(moe)
    return dense + expert


def _candidates(run: RunConfig) -> list[tuple[str, list[str]]]:
    p, m = run.parallel, run.model
    out: list[tuple[str, list[str]]] = []
    if run.trainer.recompute.granularity != "full":
        out.append(("full recompute", ["trainer.recompute.granularity=full", "trainer.recompute.method=uniform",
                                       "trainer.recompute.num_layers=1"]))  # fmt: skip
    for devices in (p.trainer_devices * 2, p.trainer_devices * 4):
        out.append((f"{devices} trainer GPUs", [f"parallel.trainer_devices={devices}"]))
        if m.is_moe and m.moe.num_experts and p.ep * 2 <= m.moe.num_experts:
            out.append((f"{devices} trainer GPUs, EP {p.ep * 2}", [f"parallel.trainer_devices={devices}",
                                                                  f"parallel.ep={p.ep * 2}"]))  # fmt: skip
        if m.is_moe:
            etp = p.expert_tp(True) * 2
            out.append((f"{devices} trainer GPUs, expert TP {etp}", [f"parallel.trainer_devices={devices}",
                                                                    f"parallel.etp={etp}"]))  # fmt: skip
    out.append((f"CP {p.cp * 2}", [f"parallel.cp={p.cp * 2}"]))  # the same GPUs: DP / 2
    cp_devices = p.trainer_devices * 2
    out.append((f"{cp_devices} trainer GPUs, CP {p.cp * 2}", [f"parallel.trainer_devices={cp_devices}",
                                                               f"parallel.cp={p.cp * 2}"]))  # fmt: skip
    if not run.trainer.optimizer.cpu_offload and p.distributed_optimizer:
        out.append(("optimizer offload", ["trainer.optimizer.cpu_offload=true"]))
    out.append((f"TP {p.tp * 2} + SP", [f"parallel.tp={p.tp * 2}", "parallel.sequence_parallel=true"]))
    out.append((f"PP {p.pp * 2}", [f"parallel.pp={p.pp * 2}"]))
    if m.is_moe and m.moe.num_experts and p.ep * 2 <= m.moe.num_experts:
        out.append((f"EP {p.ep * 2}", [f"parallel.ep={p.ep * 2}"]))
    return out


def suggestions(run: RunConfig, limit: int = 3) -> list[str]:
    """Layout changes (one step each, plus full recompute) that make the plan fit, fewest GPUs first."""
    fitting: list[tuple[int, int, str]] = []
    base = to_dict(run)
    for index, (label, overrides) in enumerate(_candidates(run)):
        try:
            candidate = build(RunConfig, apply_overrides(base, overrides))
        except ConfigError:
            continue  # not a layout megatron can form for this model
        plan = make_plan(candidate, suggest=False)
        if plan.fits:
            peak = max(r.total for r in plan.ranks)
            text = f"{label} ({' '.join(overrides)}): {peak / GIB:.1f} GiB"
            fitting.append((candidate.parallel.trainer_devices, index, text))
    return [text for _, _, text in sorted(fitting)[:limit]]


def format_plan(plan: Plan) -> str:
    """The plan as a table: one row per trainer stage and one for the engines, in GiB."""
    run, p = plan.run, plan.run.parallel
    lines = [
        f"memory plan: {run.model.name} on {p.trainer_devices} trainer GPUs (TP {p.tp} x "
        + (f"CP {p.cp} x " if p.cp > 1 else "")
        + f"PP {p.pp} x DP {p.dp}; "
        f"EP {p.ep} x ETP {p.expert_tp(run.model.is_moe)} x EDP {p.expert_dp(run.model.is_moe)}), "
        f"recompute {run.trainer.recompute.granularity}, SP {'on' if p.sequence_parallel else 'off'}, "
        f"rows of {run.trainer.micro_batch_tokens} tokens; device {plan.device / GIB:.1f} GiB",
        f"{'':14}{'params':>9}{'weights':>9}{'grads':>8}{'optim':>8}{'activ':>8}{'logp':>7}{'push':>7}{'nccl':>7}"
        f"{'rsrv':>7}{'total':>8}",
    ]
    for r in plan.ranks:
        params = (r.dense_params + r.expert_params) / 1e9
        lines.append(
            f"trainer PP{r.stage:<6}{params:>8.2f}B{r.weights / GIB:>9.1f}{r.gradients / GIB:>8.1f}"
            f"{r.optimizer / GIB:>8.1f}{r.activations / GIB:>8.1f}{r.logprobs / GIB:>7.1f}{r.push / GIB:>7.1f}"
            f"{r.nccl / GIB:>7.1f}{r.reserve / GIB:>7.1f}{r.total / GIB:>8.1f}"
        )
    lines.append(
        f"  (push: a weight push between steps, instead of activ + logp when larger; rank 0 sends "
        f"{run.rollout.sync_bucket_mb} MiB buckets, largest tensor {plan.push.largest_name} "
        f"{plan.push.largest / GIB:.2f} GiB)"
    )
    if plan.engine is not None:
        e, engine = plan.engine, run.rollout.engine
        lines.append(
            f"engine TP{engine.tp:<5}{'':>9}{e.weights / GIB:>9.1f}   KV pool {max(e.pool, 0) / GIB:.1f} GiB "
            f"(mem_fraction {engine.mem_fraction}): {e.fitting} of the {e.in_flight} sequences in flight per "
            f"engine fit at {e.longest} tokens each (room for {e.pool_sequences}); request table "
            f"{e.request_table / GIB:.2f} GiB ({e.requests} slots x context {e.context})"
        )
    if plan.routing is not None:
        rt = plan.routing
        lines.append(
            f"routing replay: {rt.per_token} B per token; a step's records at most {rt.batch / GIB:.2f} GiB on each "
            f"trainer rank's host; engine host cache {rt.engine_host / GIB:.2f} GiB, device "
            f"{rt.engine_device / 2**20:.0f} MiB; trainer device {rt.trainer_device / 2**20:.1f} MiB per MoE layer"
        )
    if run.trainer.optimizer.cpu_offload:
        host = max(r.optimizer_host for r in plan.ranks)
        lines.append(
            f"optimizer offload: {run.trainer.optimizer.offload_fraction:g} of the Adam state on the host, "
            f"{host / GIB:.1f} GiB per rank ({HOST_OPTIMIZER_BYTES:.0f} B per offloaded parameter); the trainer ranks "
            f"of a node need {plan.host_per_node / GIB:.0f} GiB of compute.host_memory_gib="
            f"{run.compute.host_memory_gib:.0f}"
        )
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.fits:
        lines.append("plan: fits")
    else:
        lines += [f"plan: does not fit: {problem}" for problem in plan.problems]
        lines += [f"  fits with: {s}" for s in plan.suggestions] or ["  no single layout change makes it fit"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# The GPU build: megatron's Transformer Engine spec with the cluster's switches, through the TE stand-in


@dataclass
class GpuBuild:
    """What building the trainer as a GPU node does found (`gpu_build_check`)."""

    checked: bool
    summary: str
    problems: list[str] = field(default_factory=list)


def gpu_build_check(run: RunConfig, plan: Plan | None = None) -> GpuBuild:
    """Build every pipeline stage's first rank as a GPU node with the image's packages would: Transformer Engine's
    layer spec and the kernel switches the node resolves (`cluster_performance_settings`), megatron-core's own
    validation included, on the meta device, with trainer/te_standin.py standing in for TE and checking each
    constructor call against TE's signatures. In a fresh process (the stand-in must be in place before
    megatron-core is imported). With `plan`, the stage parameter counts must equal the plan's (built with the
    local spec). Nothing to do for the local spec, or where Transformer Engine itself is installed (the node
    builds it for real at start)."""
    import importlib.util
    import json
    import subprocess
    import sys

    if run.trainer.layer_spec == "local":
        return GpuBuild(False, "trainer.layer_spec=local: megatron-core's local spec, as the memory plan builds it")
    if importlib.util.find_spec("transformer_engine") is not None:
        return GpuBuild(False, "Transformer Engine is installed here: the trainer builds with it at start")
    child = "from megatron_rl.plan import _gpu_build_child; _gpu_build_child()"
    done = subprocess.run(
        [sys.executable, "-c", child], input=json.dumps(to_dict(run)), capture_output=True, text=True, check=False
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        raise RuntimeError(f"GPU build check failed: {done.stderr.strip()[-2000:]}")
    result = json.loads(lines[-1])
    problems = [result["problem"]] if result["problem"] else []
    if plan is not None and not problems:
        for stage, (dense, expert) in enumerate(result["stages"]):
            rank = plan.ranks[stage]
            if (dense, expert) != (rank.dense_params, rank.expert_params):
                problems.append(
                    f"trainer stage {stage}: Transformer Engine's spec holds {dense:,} + {expert:,} expert parameters, "
                    f"the plan counted {rank.dense_params:,} + {rank.expert_params:,}"
                )
    return GpuBuild(True, result["summary"], problems)


def _gpu_build_child() -> None:
    """`gpu_build_check`'s process: reads the run's config (JSON) on stdin, prints one JSON line."""
    import json
    import sys
    from collections import Counter

    from megatron_rl.trainer import te_standin

    te_standin.install()
    run = build(RunConfig, json.loads(sys.stdin.read()))
    out: dict = {"stages": [], "problem": None, "summary": ""}
    try:
        for stage in range(run.parallel.pp):
            params = stage_parameters(run, stage)
            out["stages"].append([params.dense, params.expert])
    except ConfigError as exc:
        out["problem"] = str(exc)
    except te_standin.TEStandinError as exc:
        out["problem"] = f"trainer.performance / trainer.layer_spec: {exc}"
    built = Counter(call.cls for call in te_standin.CALLS if call.method == "__init__")
    flags = sorted(
        {
            f"{name}={call.arguments[name]}"
            for call in te_standin.CALLS
            if call.method == "__init__"
            for name in ("fuse_wgrad_accumulation", "sequence_parallel", "params_dtype")
            if name in call.arguments
        }
    )
    modules = ", ".join(f"{count} {cls}" for cls, count in sorted(built.items()))
    out["summary"] = f"Transformer Engine {te_standin.VERSION} (stand-in): {modules}; {', '.join(flags)}"
    print(json.dumps(out))
