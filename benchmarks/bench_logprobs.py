"""Peak memory and time of the fp32 log-prob path: chunked (trainer/logprobs.py) vs naive full logits.

    python benchmarks/bench_logprobs.py [--tokens 4096] [--vocab 131072] [--hidden 1024] [--chunk 256]

Each variant runs forward + backward in a fresh process; the table reports the peak resident memory
above the inputs (hidden states, LM-head weight, their gradients' buffers excluded by measuring after
a warm-up allocation of the same size) and the wall time. The target (issue 4): chunked <= 1/8 of naive.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _worker(variant: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict[str, float]:
    import torch

    from megatron_rl.trainer.logprobs import naive_token_logprobs, token_logprobs

    torch.manual_seed(0)
    torch.set_num_threads(2)
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = (0.02 * torch.randn(vocab, hidden)).requires_grad_()
    y = torch.randint(0, vocab, (tokens,))
    # The gradients of h and w exist in both variants: allocate them up front so they count as baseline.
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if variant == "chunked":
        logprobs, _ = token_logprobs(h, w, y, chunk=chunk)
    else:
        logprobs, _ = naive_token_logprobs(h, w, y)
    logprobs.sum().backward()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_mib": (peak - baseline) / 1024, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.tokens, args.vocab, args.hidden, args.chunk)))
        return
    results = {}
    for variant in ("naive", "chunked"):
        out = subprocess.run(
            [sys.executable, __file__, "--worker", variant, *sys.argv[1:]], capture_output=True, text=True, check=True
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"log-prob path, {args.tokens} tokens x {args.vocab} vocab, hidden {args.hidden}, fp32, forward+backward")
    print(f"{'variant':<22}{'peak MiB above inputs':>24}{'seconds':>10}")
    for variant, r in results.items():
        label = f"chunked ({args.chunk} rows)" if variant == "chunked" else "naive full logits"
        print(f"{label:<22}{r['peak_mib']:>24.0f}{r['seconds']:>10.2f}")
    ratio = results["chunked"]["peak_mib"] / max(results["naive"]["peak_mib"], 1e-9)
    print(f"chunked / naive peak memory: {ratio:.3f} (target <= 0.125)")


if __name__ == "__main__":
    main()
