"""The cost model (megatron_rl/scaling/cost.py) against published RL step times: NeMo-RL's GRPO on H100.

    python benchmarks/bench_cost_model.py [--json out.json]

The model's two free efficiencies are calibrated on one published breakdown, then checked on other runs:

- calibration: NeMo-RL v0.3's per-phase table (blog "NeMo-RL V0.3: Scalable and Performant Post-training with
  Nemo-RL via Megatron-Core", 2025-07-21, quoted in NVIDIA-NeMo/RL issue #959): Llama-3.1-8B-Instruct, Megatron
  backend (TP 1, PP 2, no activation checkpointing: that release's grpo_math_8B_megatron.yaml), 1 node x 8 GPUs,
  64 prompts x 32 generations, 4,096-token budget, 795 generated tokens per sample on
  average: policy training 28 s, generation 58 s, log-probs 18 s, refit 5 s, 112 s per step. Training's MFU is
  solved from 28 s, the decode bandwidth efficiency from 58 s.
- checks: NeMo-RL's performance summary (docs/about/performance-summary.md, tables "Nemo RL v0.5" and v0.6;
  recipes examples/configs/recipes/llm/performance/*.yaml): Llama-3.1-8B on 16 H100 (on-policy: colocated,
  Megatron TP1 PP2 with activation checkpointing, vLLM TP1; 1-step-off: 8 generation + 8 training GPUs) and
  Qwen3-30B-A3B on 32 H100 (on-policy: colocated, EP8, vLLM TP2; 1-step-off: 16 + 16), 64 x 32 samples,
  4,096-token budget, the published mean generated lengths.

How NeMo-RL's schedule is composed from the model's parts (it differs from ours): colocated on-policy runs one
phase after the other on the same GPUs, step = generation round + training + two log-prob forwards (policy and
reference) + refit; 1-step-off runs generation on its own GPUs beside training, step = max(generation round,
training + log-probs + refit). A generation round starts every sample at once, so its longest completions set its
length (cost.py's `round_s`). The prompt is taken as 127 tokens (the published tokens/s/GPU imply 90-130 prompt
tokens per sample over the generated mean).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from megatron_rl.config import load_config
from megatron_rl.scaling.cost import GPUS, Efficiency, _Decode, parameters, step_cost

PROMPT = 127
BUDGET = 4096


@dataclasses.dataclass
class Case:
    name: str
    model: str
    gpus: int
    colocated: bool
    generator_gpus: int
    engine_tp: int
    trainer_overrides: list[str]
    mean_generated: float
    published_s: float
    source: str


NO_TP = ["parallel.tp=1", "parallel.sequence_parallel=false", "trainer.recompute.granularity=full"]
# grpo_math_8B_megatron.yaml of that release: TP 1, PP 2, no activation checkpointing
CALIBRATION = Case(
    "Llama-3.1-8B, 8 GPUs, colocated (v0.3 breakdown)", "llama3_8b", 8, True, 8, 1,
    [*NO_TP[:2], "trainer.recompute.granularity=none", "parallel.pp=2"], 795, 112.0,
    "NeMo-RL v0.3 blog table via NVIDIA-NeMo/RL#959",
)  # fmt: skip
SUMMARY_V05, SUMMARY_V06 = "performance-summary.md v0.5 (H100 BF16)", "performance-summary.md v0.6 (H100 BF16)"
CHECKS = [
    Case("Llama-3.1-8B on-policy, 16 H100", "llama3_8b", 16, True, 16, 1, [*NO_TP, "parallel.pp=2"], 1019, 92.8,
         SUMMARY_V05),
    Case("Llama-3.1-8B 1-step-off, 8 + 8 H100", "llama3_8b", 8, False, 8, 1, [*NO_TP, "parallel.pp=1"], 1123, 64.8,
         SUMMARY_V05),
    Case("Qwen3-30B-A3B on-policy, 32 H100", "qwen3_30b_a3b", 32, True, 32, 2, [*NO_TP, "parallel.pp=1",
         "parallel.ep=8"], 3203, 192.0, SUMMARY_V06),
    Case("Qwen3-30B-A3B 1-step-off, 16 + 16 H100", "qwen3_30b_a3b", 16, False, 16, 2, [*NO_TP, "parallel.pp=2",
         "parallel.ep=8"], 3201, 152.0, SUMMARY_V06),
]  # fmt: skip


def _run(case: Case) -> object:
    overrides = [
        f"parallel.trainer_devices={case.gpus}",
        *case.trainer_overrides,
        "rollout.prompts_per_step=64",
        "rollout.generations_per_prompt=32",
        f"rollout.max_prompt_tokens={2 * PROMPT}",
        f"rollout.engine.num_engines={case.generator_gpus // case.engine_tp}",
        f"rollout.engine.tp={case.engine_tp}",
    ]
    return load_config("scalerl", case.model, overrides)


def parts(case: Case, eff: Efficiency) -> dict[str, float]:
    """The model's seconds for each phase of the case, composed as NeMo-RL schedules them."""
    run = _run(case)
    cost = step_cost(run, "h100", eff, response_tokens=case.mean_generated)
    peak, bandwidth = GPUS["h100"]
    decode = _Decode(run.model, parameters(run.model), case.engine_tp, peak, bandwidth, eff)
    batch = 64 * 32 / (case.generator_gpus // case.engine_tp)
    generate = decode.round_s(batch, PROMPT, case.mean_generated, BUDGET)
    logprobs = 2 * cost.forward_s
    out = {"train": cost.train_s, "generate": generate, "logprobs": logprobs, "refit": cost.push_s}
    if case.colocated:
        out["step"] = generate + cost.train_s + logprobs + cost.push_s
    else:
        out["step"] = max(generate, cost.train_s + logprobs + cost.push_s)
    return out


def calibrate() -> Efficiency:
    """MFU from the published 28 s of training, decode bandwidth efficiency from the 58 s of generation."""
    base = Efficiency(mfu=1.0, decode_bandwidth=1.0)
    at_peak = parts(CALIBRATION, base)
    mfu = at_peak["train"] / 28.0
    lo, hi = 0.05, 1.0  # generation time falls as the efficiency rises: bisect on it
    for _ in range(40):
        mid = (lo + hi) / 2
        if parts(CALIBRATION, dataclasses.replace(base, mfu=mfu, decode_bandwidth=mid))["generate"] > 58.0:
            lo = mid
        else:
            hi = mid
    return dataclasses.replace(Efficiency(), mfu=round(mfu, 3), decode_bandwidth=round((lo + hi) / 2, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    eff = calibrate()
    print(f"calibrated on {CALIBRATION.name}: MFU {eff.mfu}, decode bandwidth efficiency {eff.decode_bandwidth}")
    calibration = parts(CALIBRATION, eff)
    print(
        f"  its parts: train {calibration['train']:.1f} s (28), generation {calibration['generate']:.1f} s (58), "
        f"log-probs {calibration['logprobs']:.1f} s (18), refit {calibration['refit']:.1f} s (5), step "
        f"{calibration['step']:.1f} s (112)"
    )
    print()
    print("| run | published step | model step | error | model: generate / train / log-probs / refit | source |")
    print("|---|---|---|---|---|---|")
    rows = []
    for case in CHECKS:
        p = parts(case, eff)
        error = p["step"] / case.published_s - 1
        rows.append({"case": case.name, "published_s": case.published_s, **p, "error": error})
        split = f"{p['generate']:.0f} / {p['train']:.0f} / {p['logprobs']:.0f} / {p['refit']:.0f} s"
        print(f"| {case.name} | {case.published_s:g} s | {p['step']:.0f} s | {error:+.0%} | {split} | {case.source} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"efficiency": dataclasses.asdict(eff), "calibration": calibration, "checks": rows}, f, indent=2)


if __name__ == "__main__":
    main()
