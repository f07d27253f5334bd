"""The GPU path on one device, in one short run: the checks a first GPU node is asked to pass.

    python tools/gpu_smoke.py                      # on a GPU node (or anywhere: CPU runs the same checks, smaller)
    python tools/gpu_smoke.py --out DIR --steps 20 # results.json and the table under DIR

Each check prints one line (PASS, FAIL, or NOT RUN with the reason: a component this node lacks) and a table at
the end; the exit status is 1 when any check fails.

    environment  torch, CUDA device, megatron-core, Transformer Engine, Apex, SGLang as this node has them
    settings     the kernel switches this node resolves (`trainer/model.py::performance_settings`): a fusion whose
                 kernel is not installed must resolve off (megatron's ColumnParallelLinear raises at construction
                 otherwise), and megatron's output layer is built with them
    logprobs     every tiny family (llama, qwen3, qwen3_moe, llama4 with chunked attention and temperature tuning)
                 in the trainer on packed rows of several sequences against transformers' `ForCausalLM` on each
                 sequence alone: fp32 within 2e-3, bf16 (FP32 head) no further from transformers' fp32 than
                 transformers' own bf16 model is; with Transformer Engine installed, its layer spec against the
                 local spec on the same rows
    push         the weight push's stream (`iter_hf_weights`, the engines' names and dtype) from a trained model:
                 every tensor a transformers model of the family expects, and that model's log-probs equal the
                 trainer's after training
    replay       MoE rollout routing replay: the tiny Qwen3-MoE's and Llama-4's trainer log-probs with random
                 generator routing records against transformers routing by the same records (fp32 within 2e-3), and
                 a train step with replay under full recompute, GSPO, token-level TIS and sequence masking
    cp           context parallelism's own exchange (`trainer/context_parallel.py::attend`: the local spec's and
                 Llama-4's chunked layers' CP attention) on this device, the CP ranks simulated in one process:
                 every rank's queries against the whole row's keys and values equal causal attention over each
                 whole sequence (plain and chunked, GQA; fp32 within 1e-4, bf16 within 2e-2), and on CUDA a
                 Scout-sized chunked run (32k row, 8,192-token chunks) stays far below the [heads, chunk, chunk]
                 scores a math-kernel fallback would hold
    loop         `trainer.train_step` on the ScaleRL recipe (CISPO, bf16, FP32 head, full recompute) for
                 `--steps` steps of synthetic rollouts on a mid-size model (qwen3_4b: all 36 layers where the
                 device holds them, 18 otherwise; cpu_demo on CPU): step time, tokens/s, MFU, peak memory against
                 the memory plan's trainer rank, the push's transient against the plan's push column

    engine       where SGLang is installed: the trained tiny policy pushed in flight into a real SGLang engine over
                 the weight-sync group (NCCL between two GPUs; gloo on CPU), the engine's log-probs of what it
                 samples next against the trainer's (fp32 engine, within 1e-3), and a push into a SIGSTOPped engine
                 failing within `rollout.sync_timeout_s` (20 s here). NCCL refuses two ranks on one GPU, so a
                 one-GPU node does not run it.

The smoke tier of the test suite runs this script (`pytest -m gpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.trainer_devices=1"]
# Llama-4's chunk cuts and temperature steps inside rows of 40-100 tokens
# (as tests/integration/trainer/test_llama4_attention)
LLAMA4_RULES = [
    "model.attention_chunk_size=8",
    "model.attn_temperature_tuning=true",
    "model.floor_scale=16",
    "model.attn_scale=0.5",
    "model.max_position_embeddings=256",
]
FAMILIES = {"llama": ("tiny_dense", []), "qwen3": ("tiny_qwen3", []), "qwen3_moe": ("tiny_moe", []),
            "llama4": ("tiny_llama4", LLAMA4_RULES)}  # fmt: skip
FP32_TOLERANCE = 2e-3
"""Max |log-prob difference| of an fp32 trainer against transformers in fp32 (summation order, fused kernels)."""


class NotRun(Exception):
    """A check this node cannot run (a component it lacks); not a failure."""


class CheckFailed(AssertionError):
    """A failed check, with the numbers it measured."""

    def __init__(self, message: str, numbers: dict[str, Any]) -> None:
        super().__init__(message)
        self.numbers = numbers


# --------------------------------------------------------------------------------------------------
# Inputs


def synthetic_groups(
    seed: int, prompts: int, group: int, vocab: int, prompt_len: tuple[int, int], completion_len: tuple[int, int]
) -> list[Any]:
    """Random groups with rewards of both signs (non-zero advantages), generator log-probs near uniform."""
    from megatron_rl.rollout.types import random_groups

    return random_groups(seed, prompts, group, vocab, prompt_len, completion_len, gen_logprob=-math.log(vocab))


def hf_logprobs(model: Any, groups: list[Any], device: torch.device) -> list[list[float]]:
    """transformers' log-probs of every completion token, one sequence at a time (no packing)."""
    out = []
    with torch.no_grad():
        for group in groups:
            for c in group.completions:
                tokens = list(c.prompt_tokens) + list(c.tokens)
                logits = model(torch.tensor([tokens], device=device)).logits[0].double()
                logp = torch.log_softmax(logits, -1)
                targets = torch.tensor(tokens[len(c.prompt_tokens) :], device=device)
                out.append(logp[len(c.prompt_tokens) - 1 : -1].gather(1, targets[:, None]).squeeze(1).tolist())
    return out


def max_mean_diff(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    diffs = [abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return max(diffs), sum(diffs) / len(diffs)


# --------------------------------------------------------------------------------------------------
# The trainer in this process (megatron's parallel state is process-global: every check uses one rank)


@contextlib.contextmanager
def trainer_for(recipe: str, model: str, overrides: list[str]) -> Iterator[Any]:
    from megatron_rl.config import load_config
    from megatron_rl.trainer.step import Trainer

    run = load_config(recipe, model, SINGLE + overrides)
    trainer = Trainer(run)
    try:
        yield trainer
    finally:
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def load_hf(trainer: Any, hf_dir: Path) -> None:
    from megatron_rl.convert import load_hf_into_model

    load_hf_into_model(trainer.model, trainer.run.model, hf_dir)
    trainer.optimizer.reload_model_params()


# --------------------------------------------------------------------------------------------------
# Checks: each returns a dict of numbers (and raises AssertionError on failure, NotRun when it cannot run)


def check_environment(ctx: dict[str, Any]) -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(name)
        except Exception:
            return None

    cuda = torch.cuda.is_available()
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "megatron_core": version("megatron-core") or version("megatron_core"),
        "transformer_engine": version("transformer-engine") or version("transformer_engine"),
        "apex_wgrad_kernel": importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
        "sglang": version("sglang"),
        "transformers": version("transformers"),
        "python": sys.version.split()[0],
    }
    ctx["cuda"] = cuda
    if info["megatron_core"] is None:
        raise AssertionError("megatron-core is not installed")
    return info


def check_settings(ctx: dict[str, Any]) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_rl.config import load_config
    from megatron_rl.trainer.distributed import init_distributed
    from megatron_rl.trainer.model import (
        apex_wgrad_kernel,
        performance_settings,
        transformer_config,
        use_transformer_engine,
    )

    run = load_config("scalerl", "qwen3_4b", SINGLE)
    te = use_transformer_engine(run.trainer)
    perf = performance_settings(run.trainer)
    if perf["gradient_accumulation_fusion"] and not apex_wgrad_kernel():
        raise AssertionError("gradient_accumulation_fusion resolves on without Apex's fused_weight_gradient_mlp_cuda")
    init_distributed(run.parallel, seed=0)
    assert parallel_state.model_parallel_is_initialized()
    config = transformer_config(run.model, run.parallel, run.trainer)
    linear = ColumnParallelLinear(  # GPTModel's output layer, as megatron builds it, at a small vocabulary
        run.model.hidden_size, 1024, config=config, init_method=config.init_method, bias=False, skip_bias_add=False
    )
    device = next(linear.parameters()).device.type
    return {"transformer_engine": te, **perf, "output_layer_device": device}


def check_logprobs(ctx: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from megatron_rl.config import load_config
    from megatron_rl.models.tiny import build_tiny_model

    device = torch.device("cuda") if ctx["cuda"] else torch.device("cpu")
    te_installed = ctx["environment"].get("transformer_engine") is not None and ctx["cuda"]
    results: dict[str, Any] = {}
    failures = []
    batch_shape = {"prompts": 3, "group": 3, "prompt_len": (15, 30), "completion_len": (25, 70)}
    for fam, (name, rules) in FAMILIES.items():
        cfg = load_config("scalerl-cpu", name, rules + SINGLE).model
        hf_dir = build_tiny_model(Path(ctx["tmp"]) / name, cfg, seed=5, std=0.2)
        ctx.setdefault("tiny", {})[fam] = (name, rules, hf_dir)
        groups = synthetic_groups(5, vocab=cfg.vocab_size, **batch_shape)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").to(device)
        expected = hf_logprobs(hf, groups, device)
        hf_bf16 = hf_logprobs(hf.to(torch.bfloat16), groups, device)
        del hf
        row: dict[str, Any] = {"hf_bf16_mean": max_mean_diff(hf_bf16, expected)[1]}
        base = rules + ["trainer.micro_batch_tokens=512"]
        for dtype in ("fp32", "bf16"):
            local_spec = base + [f"trainer.params_dtype={dtype}", "trainer.layer_spec=local"]
            with trainer_for("scalerl-cpu", name, local_spec) as t:
                load_hf(t, hf_dir)
                got = t.compute_logprobs(groups)
            worst, mean = max_mean_diff(got, expected)
            row[f"{dtype}_max"], row[f"{dtype}_mean"] = worst, mean
            if dtype == "fp32" and worst > FP32_TOLERANCE:
                failures.append(f"{fam} fp32: max |dlogp| {worst:.2e} > {FP32_TOLERANCE:.0e}")
            if dtype == "bf16" and mean > max(row["hf_bf16_mean"], 1e-3):
                failures.append(f"{fam} bf16: mean |dlogp| {mean:.2e} > transformers' bf16 {row['hf_bf16_mean']:.2e}")
            if dtype == "bf16" and te_installed:
                local = got
                with trainer_for(
                    "scalerl-cpu", name, base + ["trainer.params_dtype=bf16", "trainer.layer_spec=transformer_engine"]
                ) as t:
                    load_hf(t, hf_dir)
                    te_got = t.compute_logprobs(groups)
                row["te_vs_local_max"], row["te_vs_local_mean"] = max_mean_diff(te_got, local)
                if row["te_vs_local_mean"] > max(row["hf_bf16_mean"], 1e-3):
                    failures.append(f"{fam} TE vs local: mean |dlogp| {row['te_vs_local_mean']:.2e}")
        results[fam] = row
    results["te_spec"] = "compared" if te_installed else "not installed: local spec only"
    if failures:
        raise AssertionError("; ".join(failures))
    return results


def check_push(ctx: dict[str, Any]) -> dict[str, Any]:
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron_rl.trainer.weights import iter_hf_weights

    if "tiny" not in ctx:
        raise NotRun("needs the logprobs check's tiny models")
    device = torch.device("cuda") if ctx["cuda"] else torch.device("cpu")
    results: dict[str, Any] = {}
    failures = []
    for fam, (name, rules, hf_dir) in ctx["tiny"].items():
        overrides = rules + ["trainer.micro_batch_tokens=512", "trainer.params_dtype=fp32", "trainer.layer_spec=local"]
        overrides += ["trainer.optimizer.lr=1e-3", "trainer.optimizer.warmup_steps=0"]
        groups = synthetic_groups(7, 3, 3, 512, (15, 30), (25, 70))
        with trainer_for("scalerl-cpu", name, overrides) as t:
            load_hf(t, hf_dir)
            for _ in range(2):
                metrics = t.train_step(groups)
            trained = t.compute_logprobs(groups)
            pushed = [pair for bucket in iter_hf_weights(t.model, t.run.model, dtype=torch.float32) for pair in bucket]
            engine_names = [n for bucket in iter_hf_weights(t.model, t.run.model, engine=True) for n, _ in bucket]
            steps = t.step
        # The pushed stream as a checkpoint beside the starting model's config: transformers loads it by the names
        # a checkpoint has (its own in-memory layout may fuse experts), as SGLang's loader does.
        expected_names = set(safe_open(hf_dir / "model.safetensors", "pt").keys())
        names = {n for n, _ in pushed}
        missing, extra = expected_names - names, names - expected_names
        out = Path(ctx["tmp"]) / f"pushed_{name}"
        out.mkdir()
        shutil.copy(hf_dir / "config.json", out / "config.json")
        save_file({n: w.contiguous().cpu() for n, w in pushed}, out / "model.safetensors")
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").to(device)
        worst, mean = max_mean_diff(hf_logprobs(hf, groups, device), trained)
        results[fam] = {"tensors": len(pushed), "engine_tensors": len(engine_names), "steps": steps,
                        "loss": metrics["train/loss"], "max": worst, "mean": mean}  # fmt: skip
        if missing or extra:
            failures.append(f"{fam}: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
        if steps != 2:
            failures.append(f"{fam}: {2 - steps} of 2 steps skipped")
        if worst > FP32_TOLERANCE:
            failures.append(f"{fam}: pushed weights give max |dlogp| {worst:.2e} against the trainer")
    if failures:
        raise AssertionError("; ".join(failures))
    return results


@contextlib.contextmanager
def forced_routing(model: Any, routers: list[Any], records: Callable[[str], Any]) -> Iterator[None]:
    """transformers' MoE routers choose the recorded experts: each router's `torch.topk` answers with the records of
    its layer (the values gathered from what it ranks), for the forward of one sequence at a time."""
    handles, original = [], torch.topk
    state: dict[str, Any] = {}

    def forced(values: torch.Tensor, k: int, dim: int = -1, **kwargs: Any) -> Any:
        index = state["experts"].to(values.device)
        return torch.return_types.topk((values.gather(1, index), index))

    for layer, router in enumerate(routers):

        def pre(module: Any, args: Any, layer: int = layer) -> None:
            state["experts"] = records("records")[:, layer]
            torch.topk = forced  # type: ignore[assignment]

        def post(module: Any, args: Any, output: Any) -> None:
            torch.topk = original

        handles += [router.register_forward_pre_hook(pre), router.register_forward_hook(post)]
    try:
        yield
    finally:
        torch.topk = original
        for handle in handles:
            handle.remove()


def check_replay(ctx: dict[str, Any]) -> dict[str, Any]:
    """Rollout routing replay on this device: the MoE families' trainer log-probs with random generator routing
    records equal transformers routing by the same records (fp32), and a train step with replay under full recompute
    (REPLAY_BACKWARD), GSPO and both mismatch corrections is taken, with its routing agreement logged."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    if "tiny" not in ctx:
        raise NotRun("needs the logprobs check's tiny models")
    device = torch.device("cuda") if ctx["cuda"] else torch.device("cpu")
    results: dict[str, Any] = {}
    failures = []
    for fam in ("qwen3_moe", "llama4"):
        name, rules, hf_dir = ctx["tiny"][fam]
        groups = synthetic_groups(9, 3, 3, 512, (15, 30), (25, 70))
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").to(device)
        cfg = hf.config
        experts, topk = cfg.num_experts if fam == "qwen3_moe" else cfg.num_local_experts, cfg.num_experts_per_tok
        rng = np.random.default_rng(9)
        for group in groups:
            for c in group.completions:
                draws = rng.random((len(c.prompt_tokens) + len(c.tokens) - 1, cfg.num_hidden_layers, experts))
                c.routed_experts = np.argsort(draws, axis=-1)[..., :topk].astype(np.uint8)
        routers = [layer.mlp.gate if fam == "qwen3_moe" else layer.feed_forward.router for layer in hf.model.layers]
        current: dict[str, Any] = {}
        expected = []
        with forced_routing(hf, routers, current.__getitem__):
            for group in groups:
                for c in group.completions:
                    last = torch.arange(topk).expand(1, cfg.num_hidden_layers, topk)  # the last token predicts nothing
                    current["records"] = torch.cat([torch.from_numpy(c.routed_experts.astype(np.int64)), last])
                    expected += hf_logprobs(hf, [type(group)(group.prompt_id, group.task, [c])], device)
        del hf
        overrides = rules + ["trainer.micro_batch_tokens=512", "trainer.params_dtype=fp32", "trainer.layer_spec=local"]
        overrides += ["algo.routing_replay=rollout", "trainer.recompute.granularity=full", "algo.loss=gspo"]
        overrides += ["algo.tis_cap=2.0", "algo.mismatch_mask=20"]
        with trainer_for("scalerl-cpu", name, overrides) as t:
            load_hf(t, hf_dir)
            got = t.compute_logprobs(groups)
            metrics = t.train_step(groups)
        worst, mean = max_mean_diff(got, expected)
        results[fam] = {"max": worst, "mean": mean, "skipped": metrics["train/skipped_steps"],
                        "agreement": metrics.get("train/routing_agreement"),
                        "masked": metrics["train/mismatch_masked"], "kl": metrics["train/mismatch_kl"]}  # fmt: skip
        if worst > FP32_TOLERANCE:
            failures.append(f"{fam}: replayed log-probs max |dlogp| {worst:.2e} against transformers' forced routing")
        if metrics["train/skipped_steps"] or not 0 <= metrics.get("train/routing_agreement", -1) < 1:
            failures.append(f"{fam}: step skipped or no routing agreement ({metrics.get('train/routing_agreement')})")
    if failures:
        raise AssertionError("; ".join(failures))
    return results


def _cp_reference(q: Any, k: Any, v: Any, segments: list[int], chunk: int | None, scale: float) -> Any:
    """Causal attention over each whole segment (cut into `chunk`-token pieces when given), [tokens, heads * dim]."""
    import torch.nn.functional as F

    outputs, start = [], 0
    for n in segments:
        pieces = range(start, start + n, chunk) if chunk else [start]
        for a in pieces:
            b = min(start + n, a + chunk) if chunk else start + n
            qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k, v))
            outputs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)[0])
        start += n
    out = torch.cat(outputs, dim=1).transpose(0, 1)
    return out.reshape(out.shape[0], -1)


def _cp_simulated(q: Any, k: Any, v: Any, segments: list[int], cp: int, chunk: int | None, scale: float) -> Any:
    """Every CP rank's `attend` in this process (the all-gather replaced by the whole row's K/V in the gathered
    order), reassembled in row order."""
    from unittest import mock

    from megatron_rl.trainer import context_parallel

    layouts = [context_parallel.cp_layout(segments, cp, r, chunk) for r in range(cp)]
    order = torch.cat([layout.index for layout in layouts]).to(q.device)
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    gathered = {id(k): k.index_select(0, order), id(v): v.index_select(0, order)}
    for layout in layouts:
        index = layout.index.to(q.device)
        local_k, local_v = k.index_select(0, index), v.index_select(0, index)
        stand_in = {id(local_k): gathered[id(k)], id(local_v): gathered[id(v)]}
        with mock.patch.object(context_parallel, "_gather_rows", lambda x, group, known=stand_in: known[id(x)]):
            part = context_parallel.attend(q.index_select(0, index), local_k, local_v, layout, scale, chunk is not None,
                                           None)  # fmt: skip
        out[index] = part
    return out


def check_cp(ctx: dict[str, Any]) -> dict[str, Any]:
    """Context parallelism's exchange-and-attend on this device against whole-sequence attention, and its memory."""
    device = torch.device("cuda") if ctx["cuda"] else torch.device("cpu")
    results: dict[str, Any] = {}
    failures = []
    segments = [4096, 1032, 12] if ctx["cuda"] else [256, 72, 12]
    chunk = 1024 if ctx["cuda"] else 64
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        generator = torch.Generator(device="cpu").manual_seed(0)
        tokens = sum(segments)
        q, k, v = (torch.randn(tokens, h, 64, generator=generator).to(device, dtype) for h in (8, 2, 2))
        for chunked in (None, chunk):
            expected = _cp_reference(q, k, v, segments, chunked, 0.125)
            got = _cp_simulated(q, k, v, segments, 2, chunked, 0.125)
            worst = float((got.float() - expected.float()).abs().max())
            key = f"{str(dtype).split('.')[-1]}_{'chunked' if chunked else 'causal'}"
            results[key] = worst
            if worst > tolerance:
                failures.append(f"{key}: max |d| {worst:.2e} > {tolerance:g}")
    if ctx["cuda"]:  # Scout at TP 4, a 32k row at CP 2: 10 query heads, 2 query groups, 8,192-token chunks
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        q, k, v = (torch.randn(32768, h, 128, device=device, dtype=torch.bfloat16) for h in (10, 2, 2))
        _cp_simulated(q, k, v, [32768], 2, 8192, 128**-0.5)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        scores = 10 * 8192 * 8192 * 2 / 2**30  # one run's [heads, chunk, chunk] bf16 scores
        results["scout_peak_gib"], results["scores_gib"] = peak, scores
        if peak > 4 * (32768 * 14 * 128 * 2) / 2**30 + scores / 2:
            failures.append(f"Scout-sized chunked run peaked at {peak:.2f} GiB: math-kernel scores ({scores:.2f})")
    if failures:
        raise AssertionError("; ".join(failures))
    return results


def check_loop(ctx: dict[str, Any]) -> dict[str, Any]:
    from megatron_rl.plan import GIB
    from megatron_rl.trainer.weights import iter_hf_weights

    cuda = ctx["cuda"]
    steps = ctx["steps"]
    if cuda:
        memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        model, layers = "qwen3_4b", (36 if memory_gib > 100 else 18)
        recipe, model, layers = "scalerl", "qwen3_4b", (36 if memory_gib > 100 else 18)
        # rows of the recipe's longest sequence (16,384 tokens and the interruption phrase's allowance)
        overrides = [f"model.num_layers={layers}", "trainer.micro_batch_tokens=16448",
                     "trainer.recompute.granularity=full", f"compute.device_memory_gib={memory_gib:.0f}"]  # fmt: skip
        shape = {"prompts": 4, "group": 4, "prompt_len": (128, 512), "completion_len": (256, 2304)}
    else:
        recipe, model, layers = "scalerl-cpu", "cpu_demo", None
        overrides = []
        shape = {"prompts": 2, "group": 4, "prompt_len": (8, 32), "completion_len": (16, 96)}
    plan = plan_numbers(recipe, model, overrides)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, tokens, metrics = [], [], {}
    memory = {"static_gib": 0.0, "forward_backward_peak_gib": 0.0, "optimizer_step_peak_gib": 0.0}
    with trainer_for(recipe, model, overrides) as t:
        if cuda:
            memory["static_gib"] = torch.cuda.memory_allocated() / GIB
            inner_step = t.optimizer.step

            def measured_step() -> Any:  # the peak of the forward/backward, then of the optimizer's step alone
                peak = memory["forward_backward_peak_gib"]
                memory["forward_backward_peak_gib"] = max(peak, torch.cuda.max_memory_allocated() / GIB)
                torch.cuda.reset_peak_memory_stats()
                out = inner_step()
                peak = memory["optimizer_step_peak_gib"]
                memory["optimizer_step_peak_gib"] = max(peak, torch.cuda.max_memory_allocated() / GIB)
                return out

            t.optimizer.step = measured_step
        for step in range(steps + 1):  # step 0 warms up (allocator, kernels) and is not timed
            groups = synthetic_groups(100 + step, vocab=t.run.model.vocab_size, **shape)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            metrics = t.train_step(groups)
            if cuda:
                torch.cuda.synchronize()
            if step:
                times.append(time.perf_counter() - started)
                tokens.append(metrics["train/tokens"])
            print(f"  loop step {step}: {metrics['train/step_time_s']:.2f} s, loss {metrics['train/loss']:.4f}, "
                  f"grad norm {metrics['train/grad_norm']:.3f}", flush=True)  # fmt: skip
        skipped = t.skipped_steps
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        started = time.perf_counter()
        pushed_bytes = sum(
            w.numel() * w.element_size()
            for bucket in iter_hf_weights(t.model, t.run.model, dtype=torch.bfloat16, engine=True)
            for _, w in bucket
        )
        if cuda:
            torch.cuda.synchronize()
        push_s = time.perf_counter() - started
        push_peak = (torch.cuda.max_memory_allocated() - before) / GIB if cuda else None
        mfu = metrics.get("train/mfu")
    median = sorted(times)[len(times) // 2]
    result = {
        "model": model if layers is None else f"{model} ({layers} layers)",
        "steps": steps,
        "median_step_s": median,
        "tokens_per_s": sum(tokens) / sum(times),
        "mfu_last": mfu,
        "skipped_steps": skipped,
        **memory,
        "push_gib_pushed": pushed_bytes / GIB,
        "push_s": push_s,
        "push_peak_gib": push_peak,
        **plan,
    }
    failures = []
    if skipped:
        failures.append(f"{skipped} of {steps + 1} steps skipped (non-finite loss or gradients)")
    if cuda and memory["forward_backward_peak_gib"] > result["plan_rank_gib"]:
        failures.append(
            f"forward/backward peak {memory['forward_backward_peak_gib']:.1f} GiB above the plan's "
            f"{result['plan_rank_gib']:.1f} GiB"
        )
    # Without Transformer Engine and Apex megatron steps with torch's AdamW, whose foreach update holds one fp32
    # temporary per parameter (the cluster's image steps with Transformer Engine's FusedAdam, in place).
    fused_adam = ctx["environment"].get("transformer_engine") or ctx["environment"].get("apex_wgrad_kernel")
    step_allowance = 0.0 if fused_adam else 4.0 * plan["local_params"] / GIB
    result["plan_optimizer_step_gib"] = plan["plan_steady_gib"] + step_allowance
    if cuda and memory["optimizer_step_peak_gib"] > result["plan_optimizer_step_gib"]:
        failures.append(
            f"optimizer step peak {memory['optimizer_step_peak_gib']:.1f} GiB above the plan's "
            f"{result['plan_optimizer_step_gib']:.1f} GiB"
        )
    if cuda and push_peak is not None and push_peak > plan["plan_push_gib"]:
        failures.append(f"push transient {push_peak:.2f} GiB above the plan's {plan['plan_push_gib']:.2f} GiB")
    if failures:
        raise CheckFailed("; ".join(failures), result)
    return result


def engine_cuda_device(visible: str | None, count: int) -> str | None:
    """The engine check's SGLang server's CUDA_VISIBLE_DEVICES: the second device this process sees (its trainer
    holds the first), named as this process's CUDA_VISIBLE_DEVICES names it (an index, a GPU or MIG UUID). On a
    node whose devices were narrowed (`CUDA_VISIBLE_DEVICES=4,5`, a Slurm step's GPUs) the engine gets device 5,
    not the machine's device 1, which may be another job's. None with fewer than two devices: NCCL refuses two
    ranks (trainer and engine) on one device."""
    if count < 2:
        return None
    if visible is None:
        return "1"
    # CUDA enumerates the list up to its first invalid entry; `count` devices were found, so the second is valid.
    return visible.split(",")[1].strip()


def check_engine(ctx: dict[str, Any]) -> dict[str, Any]:
    """A trained policy pushed in flight into a real SGLang engine over the weight-sync group (NCCL on GPUs, gloo on
    CPU), the engine's log-probs of what it then samples against the trainer's, and a push into a stopped engine
    (SIGSTOP: alive, answering nothing) failing within `rollout.sync_timeout_s`."""
    import asyncio
    import os
    import signal

    if importlib.util.find_spec("sglang") is None:
        raise NotRun("SGLang is not installed on this node")
    if "tiny" not in ctx:
        raise NotRun("needs the logprobs check's tiny models")
    cuda = ctx["cuda"]
    engine_device = (
        engine_cuda_device(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()) if cuda else None
    )
    if cuda and engine_device is None:
        raise NotRun("one GPU: NCCL refuses two ranks (trainer and engine) on one device; needs two GPUs")
    from megatron_rl.config import EngineConfig, SamplingConfig, load_config
    from megatron_rl.generator.client import SGLangClient
    from megatron_rl.generator.server import SGLangServer
    from megatron_rl.generator.weight_sync import SyncError, WeightSender
    from megatron_rl.trainer.distributed import free_port
    from megatron_rl.trainer.weights import iter_hf_weights

    name, rules, hf_dir = ctx["tiny"]["llama"]
    timeout = 20
    rollout = load_config("scalerl-cpu", name, [f"rollout.sync_timeout_s={timeout}"]).rollout
    engine = EngineConfig(device="cuda" if cuda else "cpu", dtype="float32", tp=1, fp32_lm_head=True)
    server = SGLangServer(hf_dir, engine, Path(ctx["tmp"]) / "engine.log", max_total_tokens=8192, context_length=512)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if engine_device is not None:  # the trainer holds this process's device 0
        os.environ["CUDA_VISIBLE_DEVICES"] = engine_device
    try:
        server.start()
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    overrides = rules + ["trainer.micro_batch_tokens=512", "trainer.params_dtype=fp32", "trainer.layer_spec=local",
                         "trainer.optimizer.lr=1e-3", "trainer.optimizer.warmup_steps=0"]  # fmt: skip
    sender = None
    result: dict[str, Any] = {}
    try:
        asyncio.run(server.wait_ready(timeout_s=600))
        result["engine_ready_s"] = server.ready_seconds
        with trainer_for("scalerl-cpu", name, overrides) as t:
            t.train_step(synthetic_groups(7, 3, 3, 512, (15, 30), (25, 70)))
            sender = WeightSender([server.url], "127.0.0.1", free_port(), rollout)
            sender.connect()
            stream = iter_hf_weights(t.model, t.run.model, 1 << 20, dtype=torch.float32, dst=0, engine=True)
            stats = sender.send(stream, version=t.version)
            result.update({k: v for k, v in stats.items() if k in ("sync/bytes", "sync/buckets", "sync/seconds")})

            async def sample() -> list[Any]:
                client = SGLangClient(server.url)
                try:
                    prompts = [[5, 17, 42, 99], [7, 8, 9], [100, 200, 300, 400, 12]]
                    t1 = SamplingConfig(temperature=1.0, top_p=1.0)
                    segments = await asyncio.gather(*(client.generate(p, 48, [], t1, {"ignore_eos": True})
                                                      for p in prompts))  # fmt: skip
                    return list(zip(prompts, segments, strict=True))
                finally:
                    await client.close()

            sampled = asyncio.run(sample())
            from megatron_rl.rollout.types import Completion, Group

            groups = [
                Group(
                    str(i),
                    "math",
                    [Completion(str(i), "math", p, s.tokens, s.logprobs, s.versions, [True] * len(s.tokens))],
                )  # fmt: skip
                for i, (p, s) in enumerate(sampled)
            ]
            trainer_lp = t.compute_logprobs(groups)
            worst, mean = max_mean_diff([s.logprobs for _, s in sampled], trainer_lp)
            result.update({"engine_vs_trainer_max": worst, "engine_vs_trainer_mean": mean})
            versions = {v for _, s in sampled for v in s.versions}
            result["versions"] = sorted(versions)

            os.killpg(server.pid, signal.SIGSTOP)  # HTTP server, scheduler and detokenizer
            started = time.perf_counter()
            try:
                sender.send(iter_hf_weights(t.model, t.run.model, 1 << 20, dtype=torch.float32, engine=True), 99)
                result["stopped_engine"] = "push succeeded"
            except SyncError as exc:
                result["stopped_engine"] = f"SyncError: {str(exc)[:120]}"
            result["stopped_push_s"] = time.perf_counter() - started
            os.killpg(server.pid, signal.SIGCONT)
    finally:
        if sender is not None:
            sender.close()
        server.stop()
    failures = []
    if result.get("versions") != [1]:
        failures.append(f"sampled with weight versions {result.get('versions')}, expected [1]")
    if result.get("engine_vs_trainer_max", 1.0) > 1e-3:
        failures.append(f"engine vs trainer log-probs: max |d| {result['engine_vs_trainer_max']:.2e} > 1e-3")
    if not str(result.get("stopped_engine", "")).startswith("SyncError"):
        failures.append(f"push into a stopped engine: {result.get('stopped_engine')}")
    if result.get("stopped_push_s", 0.0) > timeout + 15:
        failures.append(f"push into a stopped engine took {result['stopped_push_s']:.0f} s (timeout {timeout} s)")
    if failures:
        raise CheckFailed("; ".join(failures), result)
    return result


def plan_numbers(recipe: str, model: str, overrides: list[str]) -> dict[str, float]:
    """The memory plan's trainer rank for this layout, from a fresh process (the plan forms fake process groups)."""
    spec = json.dumps([recipe, model, SINGLE + overrides])
    done = subprocess.run([sys.executable, __file__, "--plan", spec], capture_output=True, text=True, check=False)
    if done.returncode:
        raise AssertionError(f"megatron-rl plan failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print_plan(spec: str) -> None:
    from megatron_rl.config import load_config
    from megatron_rl.plan import GIB, make_plan

    recipe, model, overrides = json.loads(spec)
    plan = make_plan(load_config(recipe, model, overrides), suggest=False)
    rank = plan.ranks[0]
    numbers = {
        "plan_rank_gib": (rank.total - rank.reserve - rank.nccl) / GIB,  # what torch allocates: not NCCL's buffers
        "plan_activations_logprobs_gib": (rank.activations + rank.logprobs) / GIB,
        "plan_push_gib": plan.push.rank0 / GIB,
        "plan_steady_gib": (rank.weights + rank.gradients + rank.optimizer) / GIB,
        "local_params": rank.dense_params + rank.expert_params,
    }
    print(json.dumps(numbers))


CHECKS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "environment": check_environment,
    "settings": check_settings,
    "logprobs": check_logprobs,
    "push": check_push,
    "replay": check_replay,
    "cp": check_cp,
    "engine": check_engine,
    "loop": check_loop,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for results.json")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of the loop check")
    parser.add_argument("--only", nargs="*", default=None, choices=list(CHECKS), help="run these checks only")
    parser.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plan:
        _print_plan(args.plan)
        return 0
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        ctx: dict[str, Any] = {"tmp": tmp, "steps": args.steps, "cuda": torch.cuda.is_available()}
        for name, check in CHECKS.items():
            if args.only is not None and name not in args.only and name != "environment":
                continue
            started = time.perf_counter()
            try:
                value = check(ctx)
                status = "PASS"
            except CheckFailed as exc:
                value, status = {**exc.numbers, "error": str(exc)}, "FAIL"
            except NotRun as exc:
                value, status = {"reason": str(exc)}, "NOT RUN"
            except Exception as exc:  # a failed check is reported, the others still run
                value, status = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}, "FAIL"
            ctx[name] = value
            results[name] = {"status": status, "seconds": round(time.perf_counter() - started, 1), **value}
            print(f"[{status}] {name} ({results[name]['seconds']} s): {json.dumps(_short(value))}", flush=True)
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print()
    print(f"{'check':<12} {'status':<8} {'seconds':>8}")
    for name, row in results.items():
        print(f"{name:<12} {row['status']:<8} {row['seconds']:>8}")
    return 1 if any(r["status"] == "FAIL" for r in results.values()) else 0


def _short(value: dict[str, Any]) -> dict[str, Any]:
    def fmt(v: Any) -> Any:
        if isinstance(v, float):
            return float(f"{v:.4g}")
        if isinstance(v, dict):
            return {k: fmt(x) for k, x in v.items()}
        return v

    return {k: fmt(v) for k, v in value.items() if k != "trace"}


if __name__ == "__main__":
    sys.exit(main())
