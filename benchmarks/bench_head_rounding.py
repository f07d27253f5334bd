"""What rounding the LM head to bf16 costs in log-prob mismatch: the FP32-head question for the engines.

    OMP_NUM_THREADS=1 python benchmarks/bench_head_rounding.py [--completions 256] [--tokens 32]

SGLang on CUDA holds the head in bf16 even with --enable-fp32-lm-head (it only makes the logits fp32), so the
generator's log-probs come from a bf16-rounded head while the trainer's come from its fp32 head. This measures
that difference alone: for each tiny model (the CPU run's warmed-up policy and a random model of every family),
completions are sampled from the model, and every sampled token's log-prob is computed twice in float64 with
the body in fp32, once with the fp32 head and once with the head rounded to bf16. Printed per model: mean and
p99 |delta log p| over the sampled tokens, and the KL estimate mean(r - 1 - log r) with r = p_rounded / p_fp32,
the quantities the run logs as train/mismatch and that a mismatch correction would see.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from megatron_rl.config import load_config
from megatron_rl.models.tiny import build_tiny_model


def _policy(name: str, work: Path) -> Path:
    if name == "cpu_demo (warmed-up)":
        from megatron_rl.data.datasets import load_splits
        from megatron_rl.orchestration.warmstart import prepare_policy

        run = load_config("scalerl-cpu")
        return prepare_policy(run, load_splits(run.data))
    return build_tiny_model(work / name, load_config("scalerl-cpu", name).model, seed=3)


def measure(model_dir: Path, completions: int, tokens: int, seed: int = 0) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 47 + 38?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].repeat(completions, 1)
    with torch.no_grad():
        out = model.generate(ids, do_sample=True, top_k=0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0)
        hidden = model.model(out).last_hidden_state[:, ids.shape[1] - 1 : -1].double()
    head = model.get_output_embeddings().weight.detach()
    targets = out[:, ids.shape[1] :]
    logp = {}
    for label, weight in (("fp32", head), ("bf16", head.to(torch.bfloat16).float())):
        log_softmax = torch.log_softmax(hidden @ weight.double().t(), dim=-1)
        logp[label] = log_softmax.gather(-1, targets[..., None]).squeeze(-1)
    delta = (logp["bf16"] - logp["fp32"]).flatten()
    ratio = delta.exp()
    return {
        "tokens": float(delta.numel()),
        "mean_abs": float(delta.abs().mean()),
        "p99_abs": float(delta.abs().quantile(0.99)),
        "kl": float((ratio - 1 - delta).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = ["cpu_demo (warmed-up)", "tiny_dense", "tiny_qwen3", "tiny_moe", "tiny_llama4"]
    print(f"{'model':24s} {'tokens':>7s} {'mean |dlogp|':>13s} {'p99 |dlogp|':>12s} {'KL':>10s}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = measure(_policy(name, Path(tmp)), args.completions, args.tokens)
            print(
                f"{name:24s} {row['tokens']:7.0f} {row['mean_abs']:13.2e} {row['p99_abs']:12.2e} {row['kl']:10.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
