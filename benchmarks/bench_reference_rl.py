"""An independent learner on the default run's task: how fast can this policy learn at all?

    OMP_NUM_THREADS=1 python benchmarks/bench_reference_rl.py [--lr 1e-4] [--steps 80] [--variant trl|scalerl]

One process, plain PyTorch and Hugging Face `generate`: no megatron-core, SGLang, Ray, pipeline or
interruption. Same warm-started policy as `scalerl-cpu` (built or taken from the cache), same synthetic task
and reward function, same batch (16 prompts x 8 completions at temperature 1, 40 new tokens at most: the
recipe's thinking budget plus its answer budget), same learning rate and gradient clip. Each step samples
fresh completions from the current weights and takes one on-policy optimizer step, so every log-prob ratio
is 1 and CISPO, GRPO and REINFORCE give the same gradient up to normalisation. Two variants:

- `trl`: TRL's GRPOTrainer defaults: AdamW(0.9, 0.999, eps 1e-8), advantages scaled by the group's std,
  loss averaged over all completion tokens of the batch.
- `scalerl`: the recipe's choices: Adam(0.9, 0.95, eps 1e-15), advantages scaled by the batch's std,
  prompt-level aggregation (each prompt's tokens averaged, prompts averaged).

Zero-variance groups are left out in both (their advantages are 0). Validation: `--val-prompts` prompts held
out of the training split (its last ones), `--val-samples` completions each. A run where this learner rises
and the stack does not would point at the stack; both flat (or both collapsing) points at the task, the
policy or the learning rate. Prints one line per validation and a final table.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from megatron_rl.config import load_config
from megatron_rl.data.datasets import Prompt, load_splits
from megatron_rl.orchestration.warmstart import prepare_policy
from megatron_rl.rewards import score
from megatron_rl.rollout.session import PromptEncoder

RECIPE = "scalerl-cpu"
VARIANTS = {
    "trl": dict(betas=(0.9, 0.999), eps=1e-8, norm="group", aggregation="token"),
    "scalerl": dict(betas=(0.9, 0.95), eps=1e-15, norm="batch", aggregation="prompt"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="trl")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--val-prompts", type=int, default=256)
    parser.add_argument("--val-samples", type=int, default=4)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    run = load_config(RECIPE, None, [])
    splits = load_splits(run.data)
    policy = prepare_policy(run, splits)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    encoder = PromptEncoder(tokenizer, run.data.system_prompt, run.data.chat_template)
    (prompts,) = splits.train.values()
    train, val = prompts[: -args.val_prompts], prompts[-args.val_prompts :]
    variant = VARIANTS[args.variant]
    opt = run.trainer.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=variant["betas"], eps=variant["eps"], weight_decay=0.0
    )
    eos = tokenizer.eos_token_id
    max_new = run.rollout.interruption.max_thinking_tokens + run.rollout.answer_tokens
    G, P = run.rollout.generations_per_prompt, run.rollout.prompts_per_step

    @torch.no_grad()
    def sample(prompt: Prompt, n: int) -> list[tuple[list[int], list[int], float, bool]]:
        ids = encoder.encode(prompt)
        model.eval()
        out = model.generate(
            torch.tensor([ids] * n),
            attention_mask=torch.ones(n, len(ids), dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            pad_token_id=eos,
            eos_token_id=eos,
        )
        samples = []
        for row in out:
            tokens = row[len(ids) :].tolist()
            if eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            result = score(encoder.decode(tokens), prompt, run.rewards)
            samples.append((ids, tokens, result.reward, result.passed))
        return samples

    def validate() -> float:
        return sum(s[3] for p in val for s in sample(p, args.val_samples)) / (args.val_samples * len(val))

    started, curve = time.perf_counter(), []
    for step in range(args.steps + 1):
        if step % args.val_every == 0 or step == args.steps:
            curve.append((step, validate()))
            print(f"step {step:4d} | val {curve[-1][1]:.3f} | {time.perf_counter() - started:.0f} s", flush=True)
        if step == args.steps:
            break
        groups = [sample(p, G) for p in rng.sample(train, P)]
        rewards = [torch.tensor([s[2] for s in g]) for g in groups]
        kept = [i for i, r in enumerate(rewards) if r.std() > 0]
        if not kept:
            continue
        scale = {i: rewards[i].std() for i in kept}
        if variant["norm"] == "batch":
            batch_std = torch.cat([rewards[i] for i in kept]).std()
            scale = {i: batch_std for i in kept}
        model.train()
        optimizer.zero_grad()
        batch_tokens = sum(len(s[1]) for i in kept for s in groups[i])
        for i in kept:
            advantages = (rewards[i] - rewards[i].mean()) / (scale[i] + 1e-6)
            group_tokens = sum(len(s[1]) for s in groups[i])
            weight = 1 / batch_tokens if variant["aggregation"] == "token" else 1 / (group_tokens * len(kept))
            for (ids, tokens, _, _), advantage in zip(groups[i], advantages, strict=True):
                logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
                logprobs = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
                (-(advantage * logprobs).sum() * weight).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
        optimizer.step()

    print("\n| variant | lr | steps | val prompts x samples | " + " | ".join(f"val @{s}" for s, _ in curve) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(curve))
    cells = " | ".join(f"{v:.3f}" for _, v in curve)
    print(f"| {args.variant} | {args.lr:g} | {args.steps} | {len(val)} x {args.val_samples} | {cells} |")


if __name__ == "__main__":
    main()
