"""Trainer peak memory and step time for one packed row of N tokens: THD packing (+ recompute) vs the dense mask.

    OMP_NUM_THREADS=2 python benchmarks/bench_trainer_memory.py [--lengths 2048 4096 8192 16384]
        [--variants none selective full before] [--cap-gib 18]

Each (variant, length) runs in a fresh process: build the trainer (scaled-down Llama model, fp32), one warm-up
`train_step` on a short batch (so the gradient buffers and Adam state exist), then one `train_step` on one group
of two completions that share a 64-token prompt and fill one micro-batch row of exactly N tokens. Reported:
the peak resident set during that step above the resident set just before it (/proc/self/status VmHWM after
resetting it through /proc/self/clear_refs, heap trimmed first), and the step's wall time.

Variants: none / selective / full = the current trainer (PackedSeqParams THD rows, PackedCoreAttention on CPU)
with trainer.recompute.granularity none, selective [core_attn], full (uniform, 1 layer); before = the trainer at
commit 88958a0 (one [1, 1, L, L] block-diagonal mask per row, megatron's local DotProductAttention), run from a
temporary git worktree. Every child's address space is capped (RLIMIT_AS) so that a variant needing more memory
than the machine has fails with an allocation error, reported as out of memory, instead of exhausting the host.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEFORE_COMMIT = "88958a0"
PROMPT_TOKENS = 64
ANSWER_TOKENS = 64
VARIANTS = {
    "none": ("after, no recompute", ["trainer.recompute.granularity=none"]),
    "selective": (
        "after, selective recompute (core_attn)",
        ["trainer.recompute.granularity=selective", "trainer.recompute.modules=[core_attn]"],
    ),
    "full": (
        "after, full recompute (uniform, 1 layer)",
        ["trainer.recompute.granularity=full", "trainer.recompute.method=uniform", "trainer.recompute.num_layers=1"],
    ),
    "before": ("before (dense L x L mask)", []),
}


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1))


def _batch(tokens: int, vocab: int, seed: int) -> list:
    """One group of two completions sharing a prompt, PROMPT_TOKENS + 2 completions = `tokens` in all."""
    import random

    from megatron_rl.rollout.types import Completion, Group

    rng = random.Random(seed)
    prompt = [rng.randrange(5, vocab) for _ in range(PROMPT_TOKENS)]
    completions = []
    for g, length in enumerate((tokens // 2 - PROMPT_TOKENS, tokens - tokens // 2 - PROMPT_TOKENS)):
        completions.append(
            Completion(
                prompt_id="0",
                task="math",
                prompt_tokens=prompt,
                tokens=[rng.randrange(5, vocab) for _ in range(length)],
                gen_logprobs=[-9.0 + 0.1 * rng.random() for _ in range(length)],
                versions=[0] * length,
                loss_mask=[True] * length,
                reward=1.0 if g == 0 else -1.0,
            )
        )
    return [Group("0", "math", completions)]


def _child(args: argparse.Namespace) -> dict:
    cap = int(args.cap_gib * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    import ctypes
    import gc

    import torch

    import megatron_rl
    from megatron_rl.config import load_config
    from megatron_rl.trainer.step import Trainer

    torch.set_num_threads(args.threads)
    tokens = args.tokens
    overrides = [
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        f"model.ffn_hidden_size={args.ffn}",
        f"model.num_attention_heads={args.heads}",
        f"model.num_query_groups={args.heads}",
        f"model.vocab_size={args.vocab}",
        f"model.max_position_embeddings={max(tokens, 4096)}",
        "trainer.params_dtype=fp32",
        f"trainer.micro_batch_tokens={tokens}",
        f"rollout.max_prompt_tokens={PROMPT_TOKENS}",
        f"rollout.answer_tokens={ANSWER_TOKENS}",
        "rollout.interruption.min_thinking_tokens=1",
        f"rollout.interruption.max_thinking_tokens={tokens - PROMPT_TOKENS - ANSWER_TOKENS}",
        *VARIANTS[args.child][1],
    ]
    run = load_config("scalerl-cpu", "cpu_demo", overrides)
    trainer = Trainer(run)
    trainer.train_step(_batch(512, args.vocab, seed=1))  # warm-up: gradient buffers and Adam state
    batch = _batch(tokens, args.vocab, seed=0)
    libc = ctypes.CDLL("libc.so.6")
    gc.collect()
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    baseline = _status_kib("VmRSS")
    result = {"module": megatron_rl.__file__, "baseline_mib": baseline / 1024, "cap_gib": args.cap_gib}
    start = time.perf_counter()
    try:
        metrics = trainer.train_step(batch)
    except (RuntimeError, MemoryError) as error:
        if "alloc" not in str(error) and not isinstance(error, MemoryError):
            raise
        result.update(oom=True, error=str(error).splitlines()[0][:300])
        return result
    result.update(
        oom=False,
        seconds=time.perf_counter() - start,
        peak_mib=(_status_kib("VmHWM") - baseline) / 1024,
        loss=metrics["train/loss"],
        micro_batches=metrics["train/micro_batches"],
        tokens=metrics["train/tokens"],
    )
    return result


def _available_gib() -> float:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE).group(1)) / (1 << 20)


def _measure(args: argparse.Namespace, variant: str, tokens: int, before_tree: Path | None) -> dict:
    # Never let a child take the machine: cap it below what is free now (leaving 2 GiB to everything else).
    cap = min(args.cap_gib, round(_available_gib() - 2.0, 1))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if variant == "before":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(before_tree), env.get("PYTHONPATH")]))
    command = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--tokens", str(tokens)]
    command += ["--cap-gib", str(cap)]
    for name in ("layers", "hidden", "ffn", "heads", "vocab", "threads"):
        command += [f"--{name}", str(getattr(args, name))]
    started = time.perf_counter()
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-5:]
        return {"oom": False, "error": f"exit {out.returncode}: " + " | ".join(tail), "cap_gib": cap}
    result = json.loads(lines[-1])
    result["process_s"] = time.perf_counter() - started
    result["load_avg_1min"] = os.getloadavg()[0]  # other jobs on the machine make the seconds noisy
    expected = str(before_tree if variant == "before" else REPO)
    if not result["module"].startswith(expected):
        raise RuntimeError(f"{variant}: imported megatron_rl from {result['module']}, expected under {expected}")
    return result


def _cell(result: dict | None) -> str:
    if result is None:
        return "-"
    if result.get("oom"):
        return f"out of memory (> {result['cap_gib']:g} GiB cap)"
    if "error" in result:
        return "error"
    return f"{result['peak_mib']:,.0f} MiB / {result['seconds']:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cap-gib", type=float, default=18.0, help="address-space cap of each measurement")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args)), flush=True)
        return

    from tqdm import tqdm

    before_tree = None
    if "before" in args.variants:
        before_tree = Path(tempfile.gettempdir()) / "mrl_before"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(before_tree), BEFORE_COMMIT],
            check=True,
            capture_output=True,
        )
    results: dict[tuple[str, int], dict] = {}
    try:
        jobs = [(v, n) for n in args.lengths for v in args.variants]
        with tqdm(jobs, unit="run") as progress:
            for variant, tokens in progress:
                progress.set_description(f"{variant} {tokens}")
                results[variant, tokens] = result = _measure(args, variant, tokens, before_tree)
                progress.write(f"{VARIANTS[variant][0]}, {tokens} tokens: {_cell(result)}  {json.dumps(result)}")
    finally:
        if before_tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before_tree)], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps([{"variant": v, "tokens": n, **r} for (v, n), r in results.items()]))

    print(
        f"\nTrainer peak RSS above the pre-step RSS, and step time: one packed row (one group of 2 completions), "
        f"Llama {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {args.heads} heads (MHA), "
        f"vocab {args.vocab}, fp32, {args.threads} threads"
    )
    header = ["tokens", *(VARIANTS[v][0] for v in args.variants)]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * len(args.variants))
    for tokens in args.lengths:
        print(f"| {tokens:,} | " + " | ".join(_cell(results.get((v, tokens))) for v in args.variants) + " |")


if __name__ == "__main__":
    main()
