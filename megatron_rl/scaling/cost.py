"""What one RL step costs: GPU-hours per step of a recipe x model x layout, before the run.

    estimate = step_cost(run)                      # seconds of each part, the overlap, GPU-hours per step
    print(format_cost(estimate))

The scaling law's x-axis is GPU-hours; a sweep at equal compute needs each configuration's cost per step before
it runs. The model, per step (docs/recipe.md §12 gives the formulas with their sources):

- **Trainer**: FLOPs = tokens x (6 N_active + 6 L d_attn s_eff), where N_active counts the matmul parameters a
  token passes through (the MoE router's top-k experts, the shared expert, attention, the LM head), d_attn =
  heads x head dim, and s_eff the mean causal context of a token (half its sequence; Llama-4's chunked layers
  capped at their chunk). Full recompute adds one forward (x 8/6), selective core-attention recompute one
  attention forward. Time = FLOPs / (trainer GPUs x peak x MFU).
- **Generation**: decoding is memory-bound: an engine's decode iteration reads its weight shard once for the
  whole batch (for an MoE, the experts the batch's tokens route to: E (1 - (1 - k/E)^b) per layer) and the KV cache
  of every running sequence; time = max(bytes / (bandwidth x efficiency), FLOPs / (peak x MFU)). The batch is
  the sequences in flight per engine (the pipeline's capacity, plan.py), the mean context half the response
  plus the prompt. Prefill is compute-bound at the trainer's MFU. Tokens per step: prompts x generations x the
  expected response length (the interruption budgets' midpoint plus half the answer budget unless given).
- **Weight push**: the bf16 weights over the sync group at `sync_gbps`, plus the engines' pause.
- **Overlap**: PipelineRL-k: max(generation, train + push) per step (generation never stops);
  PPO-off-policy-k: a round of k batches generated with frozen weights, the first k-1 train steps overlapping
  it, then the last step and the push: (max(gen_round + train, gen_round / k + k train) + push) / k.

GPU-hours per step = step seconds x (trainer + generator GPUs) / 3600. The efficiencies (MFU, bandwidth
efficiency, sync bandwidth) are stated with every estimate; `plan --calibrate RUN` compares the model with a
run's measured device-hours per step, and benchmarks/README.md "Cost model" gives its error on published runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rl.config import ModelConfig, RunConfig

GPUS: dict[str, tuple[float, float]] = {
    "h100": (989.4e12, 3.35e12),
    "h200": (989.4e12, 4.8e12),
    "a100": (312e12, 2.039e12),
    "b200": (2250e12, 8.0e12),
}
"""Dense bf16 peak FLOP/s and HBM bytes/s per GPU (NVIDIA's data sheets: H100 SXM, H200 SXM, A100 SXM 80GB,
B200)."""


@dataclass(frozen=True)
class Efficiency:
    """The model's free constants: what share of peak a real run reaches."""

    mfu: float = 0.39
    """Trainer FLOP/s over peak (recomputed FLOPs counted as work done). Calibrated on NeMo-RL's published
    Llama-3.1-8B GRPO breakdown (Megatron, H100, no recompute: 0.387; benchmarks/bench_cost_model.py), where it
    also reproduces the log-prob passes (18.5 s modelled, 18 s published); MoE training runs lower there."""
    decode_bandwidth: float = 0.45
    """Share of HBM bandwidth a decode iteration reaches; calibrated on the same breakdown's generation (vLLM,
    0.455)."""
    decode_mfu: float = 0.4
    """Share of peak FLOP/s when decoding is compute-bound (very large batches) and for prefill."""
    sync_gbps: float = 20.0
    """Weight-push bandwidth, GB/s (NCCL broadcast from trainer rank 0 to the engines, across nodes)."""
    push_overhead_s: float = 2.0
    """Fixed cost of one push: pausing the engines, the buckets' round trips, resuming."""


@dataclass
class Parameters:
    total: float
    """Every parameter (weights read by a dense engine, pushed by a sync)."""
    active: float
    """Matmul parameters one token passes through (top-k experts), the LM head included."""
    expert: float
    """Routed-expert parameters of all MoE layers."""
    attention_dim: int
    kv_bytes_per_token: float
    """K and V of one token, all layers, bf16."""


def parameters(model: ModelConfig) -> Parameters:
    """Analytic parameter counts of a model config (norms and biases left out: < 0.1%)."""
    h, L = model.hidden_size, model.num_layers
    head_dim = model.kv_channels or h // model.num_attention_heads
    q, kv = model.num_attention_heads * head_dim, model.num_query_groups * head_dim
    attention = h * q + 2 * h * kv + q * h
    moe = model.moe
    moe_layers = L // moe.layer_freq if model.is_moe else 0
    dense_layers = L - moe_layers
    dense_mlp = 3 * h * model.ffn_hidden_size
    expert_ffn = moe.ffn_hidden_size or model.ffn_hidden_size
    experts = (moe.num_experts or 0) * 3 * h * expert_ffn
    shared = 3 * h * (moe.shared_expert_ffn_hidden_size or 0)
    router = h * (moe.num_experts or 0)
    head = model.vocab_size * h
    embedding = 0 if model.tie_word_embeddings else model.vocab_size * h
    total = L * attention + dense_layers * dense_mlp + moe_layers * (experts + shared + router) + head + embedding
    active_moe = moe.router_topk * 3 * h * expert_ffn + shared + router
    active = L * attention + dense_layers * dense_mlp + moe_layers * active_moe + head
    return Parameters(float(total), float(active), float(moe_layers * experts), q, 2.0 * L * kv * 2)


@dataclass
class StepCost:
    """One step's estimate: the parts in seconds, the overlap, and the GPU-hours."""

    gpu: str
    efficiency: Efficiency
    trainer_gpus: int
    generator_gpus: int
    response_tokens: float
    tokens_per_step: float
    """Prompt + response tokens the trainer processes per step."""
    train_flops: float
    train_s: float
    generate_s: float
    """Generating one step's batch on all engines."""
    decode_batch: int
    decode_tokens_per_s: float
    """All engines together."""
    push_s: float
    step_s: float
    mode: str
    round_s: float
    """A synchronous round of generation (PPO-off-policy-k: k batches; else one): the batch started at once, its
    longest completions setting its length."""
    forward_s: float
    """One forward pass over the step's tokens on the trainer GPUs (a separate log-prob pass, as some peers run)."""

    @property
    def gpus(self) -> int:
        return self.trainer_gpus + self.generator_gpus

    @property
    def gpu_hours_per_step(self) -> float:
        return self.step_s * self.gpus / 3600.0

    @property
    def bound(self) -> str:
        return "generation" if self.generate_s >= self.train_s + self.push_s else "training"


def expected_response_tokens(run: RunConfig) -> float:
    """Tokens one completion is expected to generate, without a measurement: the midpoint of the interruption's
    thinking budgets plus half the answer budget (without interruption: half the completion budget)."""
    r = run.rollout
    if r.interruption.enabled:
        return (r.interruption.min_thinking_tokens + r.interruption.max_thinking_tokens) / 2 + r.answer_tokens / 2
    return r.max_completion_tokens / 2


def _attention_context(model: ModelConfig, sequence: float) -> float:
    """Mean keys a query attends to over the layers, for a sequence of `sequence` tokens (causal: half;
    Llama-4's chunked RoPE layers: at most half a chunk)."""
    full = sequence / 2
    if model.attention_chunk_size is None or model.no_rope_freq is None:
        return full
    chunked = min(full, model.attention_chunk_size / 2)
    nope_share = 1 / model.no_rope_freq
    return nope_share * full + (1 - nope_share) * chunked


def step_cost(
    run: RunConfig, gpu: str = "h100", efficiency: Efficiency | None = None, response_tokens: float | None = None
) -> StepCost:
    """GPU-hours per step of `run` (module docstring)."""
    if gpu not in GPUS:
        raise ValueError(f"the cost model has no figures for GPU {gpu!r}; known: {sorted(GPUS)}")
    eff = efficiency or Efficiency()
    peak, bandwidth = GPUS[gpu]
    model, r = run.model, run.rollout
    p = parameters(model)
    response = expected_response_tokens(run) if response_tokens is None else float(response_tokens)
    prompt = r.max_prompt_tokens / 2  # no measurement: half the prompt budget
    completions = r.prompts_per_step * r.generations_per_prompt
    sequence = prompt + response
    tokens = completions * sequence

    # Trainer
    attention = 6.0 * model.num_layers * p.attention_dim * _attention_context(model, sequence)
    per_token = 6.0 * p.active + attention
    recompute = run.trainer.recompute
    if recompute.granularity == "full":
        per_token *= 8.0 / 6.0
    elif recompute.granularity == "selective" and "core_attn" in recompute.modules:
        per_token += attention / 3.0
    train_flops = tokens * per_token
    trainer_gpus = run.parallel.trainer_devices
    train_s = train_flops / (trainer_gpus * peak * eff.mfu)

    # Generation on engines of engine.tp GPUs
    engine = r.engine
    decode = _Decode(model, p, engine.tp, peak, bandwidth, eff)
    batch = max(1, -(-r.groups_in_flight * r.generations_per_prompt // engine.num_engines))
    iteration_s = decode.iteration_s(batch, prompt + response / 2)
    decode_tokens_per_s = batch / iteration_s * engine.num_engines
    prefill_s = 2.0 * p.active * completions * prompt / (engine.num_engines * engine.tp * peak * eff.decode_mfu)
    generate_s = completions * response / decode_tokens_per_s + prefill_s  # continuous batching: the steady rate
    round_batch = completions * (r.k if r.mode == "ppo_off_policy" else 1) / engine.num_engines
    round_s = decode.round_s(round_batch, prompt, response, r.max_completion_tokens) + prefill_s * round_batch * (
        engine.num_engines / completions
    )
    forward_s = 2.0 * p.active * tokens / (trainer_gpus * peak * eff.mfu)
    push_s = p.total * 2.0 / (eff.sync_gbps * 1e9) + eff.push_overhead_s
    if r.mode == "pipeline":
        step_s = max(generate_s, train_s + push_s)
    else:  # a round of k batches from frozen weights: its longest completions set its length
        k = r.k
        step_s = (max(round_s + train_s, round_s / k + k * train_s) + push_s) / k
    generator_gpus = run.compute.generator_devices or engine.num_engines * engine.tp
    return StepCost(
        gpu, eff, trainer_gpus, generator_gpus, response, tokens, train_flops, train_s, generate_s, batch,
        decode_tokens_per_s, push_s, step_s, r.mode, round_s, forward_s,
    )  # fmt: skip


class _Decode:
    """Decode iterations of one engine: memory-bound (weights + KV cache read per iteration) or compute-bound."""

    def __init__(self, model: ModelConfig, p: Parameters, tp: int, peak: float, bandwidth: float, eff: Efficiency):
        self.model, self.p, self.tp, self.peak, self.bandwidth, self.eff = model, p, tp, peak, bandwidth, eff

    def iteration_s(self, batch: float, context: float) -> float:
        """One decode iteration of `batch` running sequences with `context` tokens each on average."""
        p, b = self.p, max(batch, 1.0)
        if p.expert:
            experts = self.model.moe.num_experts or 1
            touched = 1.0 - (1.0 - self.model.moe.router_topk / experts) ** b
            weights = (p.total - p.expert + p.expert * touched) * 2.0
        else:
            weights = p.total * 2.0
        memory_s = (
            (weights + b * context * p.kv_bytes_per_token) / self.tp / (self.bandwidth * self.eff.decode_bandwidth)
        )
        compute_s = 2.0 * p.active * b / self.tp / (self.peak * self.eff.decode_mfu)
        return max(memory_s, compute_s)

    def round_s(self, batch: float, prompt: float, mean: float, budget: float) -> float:
        """A synchronous round: `batch` sequences started together, lengths exponential with mean `mean` cut at
        `budget`; the iteration goes on while any sequence runs, so the longest ones set the time (the batch thins
        as the others finish)."""
        t = np.arange(int(budget), dtype=np.float64)
        alive = np.exp(-t / max(mean, 1.0))  # survival of one sequence past t tokens
        any_alive = 1.0 - (1.0 - alive) ** batch
        running = np.maximum(batch * alive / np.maximum(any_alive, 1e-300), 1.0)
        per_iteration = np.array([self.iteration_s(b, prompt + i) for b, i in zip(running[::64], t[::64], strict=True)])
        return float(np.sum(np.repeat(per_iteration, 64)[: t.size] * any_alive))


def format_cost(cost: StepCost) -> str:
    e = cost.efficiency
    return "\n".join(
        [
            f"cost per step ({cost.gpu}, {cost.trainer_gpus} trainer + {cost.generator_gpus} generator GPUs): "
            f"{cost.step_s:,.0f} s, {cost.gpu_hours_per_step:,.2f} GPU-hours ({cost.bound}-bound, {cost.mode})",
            f"  train     {cost.train_s:8,.0f} s  {cost.tokens_per_step:,.0f} tokens, {cost.train_flops:.3g} FLOPs at "
            f"MFU {e.mfu:.2f}",
            f"  generate  {cost.generate_s:8,.0f} s  {cost.response_tokens:,.0f} tokens per completion (expected), "
            f"{cost.decode_tokens_per_s:,.0f} tokens/s over the engines, {cost.decode_batch} sequences per engine; "
            f"{e.decode_bandwidth:.0%} of HBM bandwidth",
            f"  push      {cost.push_s:8,.0f} s  at {e.sync_gbps:g} GB/s + {e.push_overhead_s:g} s",
        ]
    )


def steps_at(budget_gpu_hours: float, cost: StepCost) -> int:
    """Steps a budget buys."""
    return max(0, math.floor(budget_gpu_hours / cost.gpu_hours_per_step))


@dataclass
class Calibration:
    """The model's estimate against a run's measurement, with the measured response length given to the model."""

    run: str
    steps: int
    """Training steps measured (steps with an evaluation left out: they add its time)."""
    measured_step_s: float
    measured_gpu_hours: float
    """Per step: the median increase of the run's device_hours."""
    response_tokens: float
    predicted: StepCost

    @property
    def error(self) -> float:
        """Predicted over measured GPU-hours per step, minus 1."""
        return self.predicted.gpu_hours_per_step / self.measured_gpu_hours - 1.0


def calibrate(run: RunConfig, metrics: str | Path, gpu: str = "h100") -> Calibration:
    """Compare `step_cost` with the GPU-hours per step a run measured (its metrics.jsonl), the model given the run's
    own mean response length."""
    import json
    import statistics

    rows = []
    for line in Path(metrics).read_text().splitlines()[1:]:
        if line.strip():
            rows.append(json.loads(line))
    train = [r for r in rows if "train/loss" in r and not any(k.startswith(("val/", "downstream/")) for k in r)]
    increments, lengths, times = [], [], []
    previous = {r["step"]: r for r in rows}
    for r in train:
        before = previous.get(r["step"] - 1)
        if before is not None and "device_hours" in before:
            increments.append(r["device_hours"] - before["device_hours"])
        if "train/response_length" in r:
            lengths.append(r["train/response_length"])
        if "time/step_s" in r:
            times.append(r["time/step_s"])
    if len(increments) < 3 or not lengths:
        raise ValueError(
            f"{metrics}: {len(increments)} training steps with device_hours and "
            f"{len(lengths)} with train/response_length; calibration needs at least 3 steps of both"
        )
    response = statistics.fmean(lengths)
    predicted = step_cost(run, gpu, response_tokens=response)
    measured = statistics.median(increments)
    step_s = statistics.median(times) if times else measured * 3600.0 / predicted.gpus
    return Calibration(str(metrics), len(increments), step_s, measured, response, predicted)


def format_calibration(c: Calibration) -> str:
    p = c.predicted
    return "\n".join(
        [
            f"calibration against {c.run} ({c.steps} training steps, {c.response_tokens:,.0f} tokens per completion "
            "measured):",
            f"  measured   {c.measured_gpu_hours:,.4f} GPU-hours per step ({c.measured_step_s:,.1f} s)",
            f"  predicted  {p.gpu_hours_per_step:,.4f} GPU-hours per step ({p.step_s:,.1f} s: train {p.train_s:,.1f}, "
            f"generate {p.generate_s:,.1f}, push {p.push_s:,.1f}; {p.bound}-bound)",
            f"  error      {c.error:+.0%}: scale the plan's GPU-hours for this layout by {1 / (1 + c.error):.2f}",
        ]
    )
