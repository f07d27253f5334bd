"""Transformer Engine's layer spec on CPU through trainer/te_standin.py: what a GPU node builds, run here.

Every tiny family built with `trainer.layer_spec=transformer_engine` (megatron's TELayerNormColumnParallelLinear,
TEDotProductAttention, TERowParallelLinear, TE norms, grouped-GEMM experts, the router's TE GEMM, Llama-4's rules
around TE's attention) gives transformers' log-probs on packed rows, and what megatron handed TE is what TE 2.18
accepts; TP 2 + SP and EP 2 equal one rank. `megatron-rl check`/`plan`'s GPU build runs the same spec with the
cluster's switches on the meta device for the shipped GPU models.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.trainer import te_standin

sys.path.insert(0, str(Path(__file__).parent))
from test_llama4_attention import RULES, _hf_logprobs  # noqa: E402
from test_trainer import _max_diff, _run  # noqa: E402

SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.trainer_devices=1"]
TE = [
    "trainer.layer_spec=transformer_engine",
    "trainer.micro_batch_tokens=512",  # the batch below in two rows
    # what the stand-in does not model; everything else as a GPU node resolves it (grouped GEMM experts included)
    "trainer.performance.apply_rope_fusion=false",
    "trainer.performance.moe_permute_fusion=false",
]
BATCH = {"prompts": 3, "group": 3, "prompt_len": [15, 30], "completion_len": [25, 70], "seed": 5}
FAMILIES = {"tiny_dense": [], "tiny_qwen3": [], "tiny_moe": [], "tiny_llama4": RULES}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from megatron_rl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("te")
    return {
        name: build_tiny_model(root / name, load_config("scalerl-cpu", name, rules).model, seed=5, std=0.2)
        for name, rules in FAMILIES.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_te_spec_gives_transformers_log_probs(name, tiny_models, tmp_path):
    rules = FAMILIES[name]
    spec = {"model": name, "overrides": rules + SINGLE + TE, "hf": str(tiny_models[name]), "batch": BATCH,
            "dump_batch": str(tmp_path / "batch.pt"), "te_standin": True, "steps": 1}  # fmt: skip
    (result,) = _run(tmp_path, name, spec)
    batch = torch.load(tmp_path / "batch.pt", weights_only=False)
    assert _max_diff(result["logprobs"], _hf_logprobs(tiny_models[name], batch)) < 1e-5
    assert "TEDotProductAttention" in result["layer_types"] or "TELlama4Attention" in result["layer_types"]
    assert "TELayerNormColumnParallelLinear" in result["layer_types"]
    if name in ("tiny_moe", "tiny_llama4"):
        assert "TEGroupedMLP" in result["layer_types"]  # grouped GEMM experts, as the cluster resolves them
    assert result["steps"][0]["train/skipped_steps"] == 0

    attention = [a for cls, method, a in result["te_calls"] if (cls, method) == ("DotProductAttention", "forward")]
    assert attention and all(a["qkv_format"] == "thd" and a["attn_mask_type"] == "padding_causal" for a in attention)
    assert all(a["cu_seqlens_q"]["dtype"] == "torch.int32" and isinstance(a["max_seqlen_q"], int) for a in attention)
    if name == "tiny_llama4":  # per row, layer 0 (chunked) gets the chunk cuts, layer 1 the sequence boundaries
        layer0, layer1 = attention[0:4:2], attention[1:4:2]  # the log-prob pass: 2 rows x 2 layers
        for chunked, whole in zip(layer0, layer1, strict=True):
            assert chunked["cu_seqlens_q"]["shape"][0] > whole["cu_seqlens_q"]["shape"][0]
            assert chunked["max_seqlen_q"] <= 8 < whole["max_seqlen_q"]
    linears = [a for cls, method, a in result["te_calls"] if method == "__init__" and "Linear" in cls]
    assert linears and all(a["params_dtype"] == "torch.float32" for a in linears)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("tiny_qwen3", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.trainer_devices=2"]),
        ("tiny_moe", ["parallel.ep=2", "parallel.trainer_devices=2"]),
        # TE's CP attention on the NoPE layers, the trainer's exchange on the chunked ones
        ("tiny_llama4", ["parallel.cp=2", "parallel.trainer_devices=2"]),
    ],
    ids=["qwen3_tp2_sp", "moe_ep2", "llama4_cp2"],
)
def test_the_te_spec_at_tp2_sp_and_ep2_equals_one_rank(name, layout, tiny_models, tmp_path):
    """Context parallel: Transformer Engine's attention gets the whole row's cu_seqlens and the rank's share of
    the tokens (TE's own exchange on GPUs); Llama-4's chunked layers use the trainer's exchange on either spec."""
    lr = ["trainer.optimizer.lr=1e-3", "trainer.optimizer.warmup_steps=0"]
    base = {"model": name, "hf": str(tiny_models[name]), "batch": BATCH, "te_standin": True, "steps": 2,
            "overrides": TE + FAMILIES[name] + lr}  # fmt: skip
    (one,) = _run(tmp_path, "one", {**base, "overrides": base["overrides"] + SINGLE})
    split = _run(tmp_path, "split", {**base, "overrides": base["overrides"] + SINGLE[:3] + layout}, world=2)
    for rank in split:
        assert _max_diff(rank["logprobs"], one["logprobs"]) < 1e-5
        for a, b in zip(rank["steps"], one["steps"], strict=True):
            assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)


# ------------------------------------------------------------------------------------------------
# The stand-in refuses what Transformer Engine refuses


def _attention() -> te_standin.DotProductAttention:
    return te_standin.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="thd", attn_mask_type="causal")


def _qkv(tokens: int = 10) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(tokens, 4, 8), torch.randn(tokens, 2, 8), torch.randn(tokens, 2, 8)


def test_the_stand_in_attention_is_causal_per_segment():
    q, k, v = _qkv()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out = _attention()(q, k, v, None, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6,
                       max_seqlen_kv=6, attn_mask_type="padding_causal")  # fmt: skip
    for start, end in [(0, 4), (4, 10)]:  # an independent reference: explicit masked softmax per segment
        qs, ks, vs = q[start:end], k[start:end].repeat_interleave(2, 1), v[start:end].repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / 8**0.5
        scores = scores.masked_fill(torch.ones(end - start, end - start).triu(1).bool(), float("-inf"))
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).reshape(end - start, -1)
        torch.testing.assert_close(out[start:end], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cu_seqlens_q": torch.tensor([0, 4, 10]), "cu_seqlens_kv": torch.tensor([0, 4, 10])}, "torch.int32"),
        ({"max_seqlen_q": torch.tensor(6)}, "Python int"),
        ({"max_seqlen_q": 5}, "below the longest segment"),
        ({"attn_mask_type": "causal"}, "padding or padding_causal"),
        ({"cu_seqlens_kv": None}, "can not be None"),
        ({"window_sizes": (1, 1)}, "unexpected arguments ['window_sizes']"),
    ],
)
def test_the_stand_in_refuses_what_te_refuses(change, message):
    q, k, v = _qkv()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    kwargs = {"qkv_format": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu, "max_seqlen_q": 6, "max_seqlen_kv": 6,
              "attn_mask_type": "padding_causal", **change}  # fmt: skip
    with pytest.raises(te_standin.TEStandinError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _attention()(q, k, v, None, **kwargs)


def test_the_stand_in_checks_constructors_against_te_2_18():
    assert te_standin.VERSION == "2.18.0"
    linear = te_standin.Linear(16, 8, parallel_mode="column", bias=False, params_dtype=torch.float32)
    assert linear.weight.shape == (8, 16)
    with pytest.raises(te_standin.TEStandinError, match=r"unexpected arguments \['fuse_qkv'\].*linear.py"):
        te_standin.Linear(16, 8, fuse_qkv=True)
    with pytest.raises(te_standin.TEStandinError, match="does not model"):
        te_standin._unmodelled("transformer_engine.pytorch.fp8.fp8_autocast")()


@pytest.mark.slow
def test_the_gpu_build_of_a_shipped_moe_model_passes_and_counts_what_the_plan_counts():
    from megatron_rl.plan import gpu_build_check, make_plan

    run = load_config("scalerl", "qwen3_30b_a3b")
    plan = make_plan(run, suggest=False)
    build = gpu_build_check(run, plan)
    assert build.checked and not build.problems, build.problems
    assert "48 DotProductAttention" in build.summary and "96 GroupedLinear" in build.summary
    assert "params_dtype=torch.bfloat16" in build.summary and "fuse_wgrad_accumulation=False" in build.summary
    plan.ranks[0].expert_params += 1  # a plan that counted differently is reported
    assert "the plan counted" in gpu_build_check(run, plan).problems[0]


@pytest.mark.slow
def test_every_shipped_gpu_recipe_builds_as_a_gpu_node_builds_it():
    """Recipes that differ in what the trainer builds (dtype, FP32 head, recompute, layout, model) each pass."""
    import json

    from megatron_rl.config import list_recipes, to_dict
    from megatron_rl.plan import gpu_build_check

    distinct: dict[str, str] = {}
    for recipe in list_recipes():
        run = load_config(recipe)
        if run.compute.device_kind == "gpu":
            key = json.dumps([run.model.name, to_dict(run.trainer), to_dict(run.parallel)], default=str)
            distinct.setdefault(key, recipe)
    assert len(distinct) >= 3
    for recipe in distinct.values():
        build = gpu_build_check(load_config(recipe))
        assert build.checked and not build.problems, (recipe, build.problems)
