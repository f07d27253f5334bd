"""TRL's GRPOTrainer on the default run's task, policy and validation: the peer the default run is timed against,
at TRL's fastest settings on this machine.

    pip install trl==1.16.0 accelerate        # not a dependency of megatron_rl: the peer, for this benchmark only
    python benchmarks/bench_trl.py [--steps 200] [--threads 2] [--gradient-checkpointing] [--json F] [overrides ...]

One process: TRL 1.16's `GRPOTrainer` with Hugging Face `generate` (no vLLM) on the CPU, started from the
warm-started policy that `megatron-rl train --recipe scalerl-cpu [overrides]` starts from (built or taken from
the same cache), on the same training prompts and reward function (`megatron_rl.rewards.score`), with the
recipe's batch (prompts_per_step x generations_per_prompt completions per step, temperature 1), optimizer (AdamW
with the recipe's learning rate, warm-up, betas, epsilon, weight decay and gradient clip; TRL, like megatron-core,
decays no norm or bias), and as much of the recipe's loss as TRL has: `loss_type="cispo"` with the recipe's
truncation (`epsilon_high` = algo.eps_max), advantages normalised over the batch (`scale_rewards="batch"`), no KL
term, one on-policy step per generation batch.

Speed settings, chosen by measurement on the 2-core CPU machine of benchmarks/README.md (20-step runs with the
step-0 validation, same seed, 2026-11-26): 2 threads (`torch.set_num_threads`: 55.2 steps/min, 1 thread 37.6),
gradient checkpointing off (TRL's default is on: it recomputes every layer's forward in the backward, 51.8
steps/min, for memory this model does not need), the whole batch generated at once (`generation_batch_size` = the
batch), validation in one `generate` call of all 1,024 sequences (10-step runs validating every 5 steps: 37.4
steps/min, 36.4 at 512 per call, 34.9 at 128), fp32 as the recipe (TRL's default is bf16).

Length control as the recipe's: TRL's generation is replaced through its `rollout_func` by the stack's own
interruption controller (`megatron_rl.rollout.interruption.generate_completion`: a thinking budget drawn in
[min_thinking_tokens, max_thinking_tokens], the lookahead, the injected phrase, the answer budget) over HF `generate`
(`HFEngine`: the calls of one round batched), in training and in validation alike; the injected phrase is masked out
of the loss (`env_mask`) and a completion whose answer budget ran out is left out of it
(`mask_truncated_completions`, the recipe's `algo.truncated: exclude`). What TRL cannot match: its `cispo` loss
averages over the batch's tokens where the recipe averages per prompt; zero-variance groups stay in its batch (with
zero advantage) where the recipe drops them; a truncated completion still counts in its group's advantages; its
steps are on-policy where the recipe's are PipelineRL-2. The optimizer matters most of all for how fast the
pass rate rises: at TRL's own AdamW defaults (betas 0.9 / 0.999, epsilon 1e-8, no weight decay) TRL crossed 0.7 at
step 50 of a 100-step run, at the recipe's (0.9 / 0.95, 1e-15, 0.01) at step 70 (2026-11-28, benchmarks/README.md).

Validation uses the run's own held-out prompts (`data.val_prompts`) and `eval.samples_per_prompt` samples at
temperature 1 every `eval.every_steps` steps and at step 0, with HF `generate` on TRL's current weights
(`--val-batch` sequences per call); its time counts, as it does in the stack. Wall times are measured from the first
training step's start; start-up (process start to that moment: imports, model load, TRL's set-up) is printed apart.
Prints one line per validation, the steps per minute, start-up, and the time to `--target`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import torch

from megatron_rl.config import load_config
from megatron_rl.data.datasets import load_splits
from megatron_rl.orchestration.warmstart import prepare_policy
from megatron_rl.rewards import score
from megatron_rl.rollout.interruption import Generated, Segment, generate_completion
from megatron_rl.rollout.session import PromptEncoder, interruption_tokens

RECIPE = "scalerl-cpu"
PROCESS_START = time.time()


class HFEngine:
    """The stack's engine call (`GenerateFn`: input ids, max new tokens, stop ids -> Segment) over Hugging Face
    `generate`, so the stack's own length control (`generate_completion`: thinking budget, lookahead, the injected
    phrase, the answer budget) runs on TRL's model. The calls made in one turn of the event loop run as batched
    `generate` calls of up to `batch` rows, sampled to the longest limit and each row cut at its own limit and at
    its first stop token (kept): sampling is autoregressive, so that is the completion a call with the row's own
    limit would have drawn."""

    def __init__(self, model: Any, pad_id: int, temperature: float, batch: int) -> None:
        self.model, self.pad_id, self.temperature, self.batch = model, pad_id, temperature, batch
        self.pending: list[tuple[list[int], int, list[int], asyncio.Future[Segment]]] = []

    async def __call__(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        future: asyncio.Future[Segment] = asyncio.get_running_loop().create_future()
        if not self.pending:  # runs once every completion has made its call of this turn
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append((input_ids, max_new_tokens, stop_ids, future))
        return await future

    def _flush(self) -> None:
        calls, self.pending = self.pending, []
        for start in range(0, len(calls), self.batch):
            chunk = calls[start : start + self.batch]
            for (_, limit, stop, future), segment in zip(chunk, self._generate(chunk), strict=True):
                future.set_result(_cut(segment, limit, stop))

    @torch.no_grad()
    def _generate(self, calls: list[tuple[list[int], int, list[int], Any]]) -> list[Segment]:
        width = max(len(ids) for ids, *_ in calls)
        ids = torch.tensor([[self.pad_id] * (width - len(i)) + i for i, *_ in calls])
        mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i, *_ in calls])
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=self.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(limit for _, limit, *_ in calls),
            pad_token_id=self.pad_id,
            eos_token_id=sorted({s for *_, stop, _ in calls for s in stop}),
            return_dict_in_generate=True,
            output_logits=True,
        )
        tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / self.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return [
            Segment(t.tolist(), lp.tolist(), [0] * len(t), "length") for t, lp in zip(tokens, logprobs, strict=True)
        ]


def _cut(segment: Segment, limit: int, stop: list[int]) -> Segment:
    """The row as a call with `limit` new tokens and these stop tokens would have ended."""
    tokens = segment.tokens[:limit]
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop), None)
    n, finish = (end, "stop") if end is not None else (len(tokens), "length")
    return Segment(tokens[:n], segment.logprobs[:n], segment.versions[:n], finish)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's total_steps)")
    parser.add_argument("--lr", type=float, help="learning rate (default: the recipe's)")
    parser.add_argument("--target", type=float, help="validation pass rate to time (default: start + 0.1)")
    parser.add_argument("--json", type=Path, help="write the curve and timings here")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2: fastest here)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="TRL's default; off by default here")
    parser.add_argument("--trl-optimizer", action="store_true", help="TRL's AdamW defaults, not the recipe's AdamW")
    parser.add_argument("--val-batch", type=int, default=1024, help="sequences per validation generate call")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, as for megatron-rl train")
    args = parser.parse_args()

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # `rollout_func` is marked experimental in TRL 1.16
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    run = load_config(RECIPE, None, args.overrides)
    splits = load_splits(run.data)
    policy = prepare_policy(run, splits)
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    encoder = PromptEncoder(tokenizer, run.data.system_prompt, run.data.chat_template)
    (train_prompts,) = splits.train.values()
    val_prompts = [p for prompts in splits.val.values() for p in prompts]
    by_id = {p.id: p for p in train_prompts}
    steps = args.steps or run.total_steps
    lr = args.lr or run.trainer.optimizer.lr
    G, P = run.rollout.generations_per_prompt, run.rollout.prompts_per_step
    max_new = run.rollout.interruption.max_thinking_tokens + run.rollout.answer_tokens

    # The prompt as the chat-templated text the stack sends to SGLang, so TRL applies no template of its own.
    dataset_ids = [encoder.encode(p) for p in train_prompts]
    dataset = Dataset.from_list(
        [
            {"prompt": tokenizer.decode(ids), "prompt_id": p.id}
            for ids, p in zip(dataset_ids, train_prompts, strict=True)
        ]
    )

    def reward(completion_ids: list[list[int]], prompt_id: list[str], **_: object) -> list[float]:
        # Decoded as the stack decodes (TRL's own text drops the special `<think>` tokens the reward reads).
        texts = [encoder.decode(ids) for ids in completion_ids]
        return [score(text, by_id[pid], run.rewards).reward for text, pid in zip(texts, prompt_id, strict=True)]

    engine = HFEngine(model, tokenizer.pad_token_id, run.rollout.sampling.temperature, args.val_batch)
    budgets = interruption_tokens(run.rollout, tokenizer)

    def sample(prompt_ids: list[list[int]], rng: random.Random) -> list[Generated]:
        """One completion per prompt, under the recipe's length control (interruption), batched on `engine`."""

        async def all_of_them() -> list[Generated]:
            seeds = [rng.random() for _ in prompt_ids]
            return await asyncio.gather(
                *(
                    generate_completion(engine, ids, run.rollout, budgets, random.Random(seed), lambda: 0)
                    for ids, seed in zip(prompt_ids, seeds, strict=True)
                )
            )

        return asyncio.run(all_of_them())

    @torch.no_grad()
    def validate(step: int) -> float:
        was_training = model.training
        model.eval()
        n = run.eval.samples_per_prompt
        prompts = [p for p in val_prompts for _ in range(n)]
        outs = sample([encoder.encode(p) for p in prompts], random.Random(run.seed * 1_000_003 + step))
        passed = sum(score(encoder.decode(o.tokens), p, run.rewards).passed for o, p in zip(outs, prompts, strict=True))
        model.train(was_training)
        return passed / len(prompts)

    ids_of_text = {text: ids for text, ids in zip(dataset["prompt"], dataset_ids, strict=True)}
    rollout_rng = random.Random(run.seed)

    @torch.no_grad()
    def rollout(prompts: list[str], trainer: Any) -> dict[str, list]:
        """TRL's generation replaced by the recipe's: each prompt entry (TRL repeats a prompt once per generation)
        gets one completion under interruption; the injected phrase is masked out of the loss (`env_mask`)."""
        was_training = model.training
        model.eval()
        prompt_ids = [ids_of_text[text] for text in prompts]
        outs = sample(prompt_ids, rollout_rng)
        model.train(was_training)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [o.tokens for o in outs],
            "logprobs": [o.logprobs for o in outs],
            "env_mask": [[int(m) for m in o.loss_mask] for o in outs],
        }

    curve: list[dict[str, float]] = []
    clock: dict[str, float] = {}

    class Validation(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if "start" not in clock:
                clock["start"] = time.perf_counter()
                clock["startup_s"] = time.time() - PROCESS_START
                self._validate(0)

        def on_step_end(self, _args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step % run.eval.every_steps == 0 or state.global_step == steps:
                self._validate(state.global_step)

        def _validate(self, step: int) -> None:
            rate = validate(step)
            wall = time.perf_counter() - clock["start"]
            curve.append({"step": step, "pass_rate": rate, "wall_s": wall})
            print(f"step {step:4d} | val {rate:.3f} | {wall:.0f} s", flush=True)

    opt = run.trainer.optimizer
    # The recipe's AdamW; with `--trl-optimizer` TRL's defaults (betas 0.9 / 0.999, epsilon 1e-8, no weight decay).
    adamw: dict[str, float] = dict(
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_epsilon=opt.adam_eps, weight_decay=opt.weight_decay
    )
    if args.trl_optimizer:
        adamw = dict(adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0)
    config = GRPOConfig(
        output_dir=str(Path("runs") / "bench_trl"),
        learning_rate=lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=opt.warmup_steps,
        max_grad_norm=opt.grad_clip,
        **adamw,
        loss_type="cispo",
        epsilon_high=run.algo.eps_max,
        scale_rewards="batch",
        beta=0.0,
        gradient_checkpointing=args.gradient_checkpointing,
        generation_batch_size=P * G,
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=max_new,  # unused for generation (`rollout` samples under the recipe's budgets)
        mask_truncated_completions=run.algo.truncated == "exclude",  # the answer budget ran out: not trained on
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_steps=steps,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=run.seed,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Validation()],
        rollout_func=rollout,
    )
    trainer.train()
    loop_s = time.perf_counter() - clock["start"]

    start_rate = curve[0]["pass_rate"]
    target = args.target if args.target is not None else round(start_rate + 0.1, 3)
    reached = next((p for p in curve if p["pass_rate"] >= target), None)
    print(
        f"\nTRL GRPOTrainer, {steps} steps at lr {lr:g}, {args.threads} threads, gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}: {steps / loop_s * 60:.1f} steps/min, loop {loop_s:.0f} s, "
        f"start-up {clock['startup_s']:.1f} s"
    )
    print("| step | " + " | ".join(str(int(p["step"])) for p in curve) + " |")
    print("|---|" + "---:|" * len(curve))
    print("| val | " + " | ".join(f"{p['pass_rate']:.3f}" for p in curve) + " |")
    print("| wall s | " + " | ".join(f"{p['wall_s']:.0f}" for p in curve) + " |")
    when = f"{reached['wall_s']:.0f} s (step {int(reached['step'])})" if reached else "not reached"
    print(f"time to val >= {target:.3f}: {when}")
    if args.json:
        settings = {
            "threads": args.threads,
            "gradient_checkpointing": args.gradient_checkpointing,
            "val_batch": args.val_batch,
            "optimizer": adamw,
        }
        record = {"steps": steps, "lr": lr, "loop_s": loop_s, "startup_s": clock["startup_s"], "target": target}
        args.json.write_text(json.dumps({**record, "settings": settings, "curve": curve}))


if __name__ == "__main__":
    main()
