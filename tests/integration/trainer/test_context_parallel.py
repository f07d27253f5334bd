"""Context parallelism (`parallel.cp`) on CPU with real megatron-core: a CP layout equals one rank.

Each sequence of a packed row is split over the CP ranks as Transformer Engine's THD context parallelism splits it
(2 x cp chunks, rank r holds chunks r and 2cp-1-r); the trainer's core attention all-gathers keys and values over
the CP group. Log-probs, the loss and gradient norm of two steps, and every parameter's gradient must equal a
single rank's on packed rows of odd lengths (every sequence padded for CP), alone, with TP 2 + SP, with EP 2 on the
tiny MoE, and on the tiny Llama-4 whose attention chunks (8 tokens) cross the CP chunks. A deliberately wrong
partition (each rank a contiguous half of each sequence) must fail the comparison.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_llama4_attention import RULES as LLAMA4_RULES  # noqa: E402  (8-token chunks, temperature steps of 16)
from test_trainer import _max_diff, _run, _whole_tp_grads  # noqa: E402

from megatron_rl.trainer.context_parallel import cp_layout, partition  # noqa: E402

LR = ["trainer.optimizer.lr=1e-3", "trainer.optimizer.warmup_steps=0", "parallel.distributed_optimizer=false"]
LR += ["trainer.micro_batch_tokens=512"]  # the batch below in two rows
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.trainer_devices=1"]
# Two packed rows (6 and 3 sequences) of 40-100 tokens, odd lengths: every sequence gets CP padding.
BATCH = {"prompts": 3, "group": 3, "prompt_len": [15, 30], "completion_len": [25, 70], "seed": 5}


def test_the_partition_is_transformer_engines_load_balanced_split():
    """TE's thd_get_partitioned_indices for cu_seqlens [0, 8, 16, 20], cp 2: each segment in 4 chunks, rank 0 holds
    chunks 0 and 3 of each, rank 1 chunks 1 and 2."""
    assert partition([8, 8, 4], 2, 0) == [(0, 2), (6, 8), (8, 10), (14, 16), (16, 17), (19, 20)]
    assert partition([8, 8, 4], 2, 1) == [(2, 4), (4, 6), (10, 12), (12, 14), (17, 18), (18, 19)]
    layouts = [cp_layout([12, 24], 3, r, chunk_size=5) for r in range(3)]
    held = torch.cat([layout.index for layout in layouts])
    assert sorted(held.tolist()) == list(range(36))  # every token on exactly one rank
    gathered = torch.cat([layout.index for layout in layouts])  # what an all-gather of the positions returns
    assert torch.equal(gathered[layouts[0].gather_index], torch.arange(36))  # back in row order
    # rank 1 holds [2, 4) and [8, 10) of segment 0 and [16, 20), [28, 32) of segment 1 (starting at 12)
    assert layouts[1].index.tolist() == [2, 3, 8, 9, 16, 17, 18, 19, 28, 29, 30, 31]
    # its queries: causal from the segment start; on chunked layers cut at chunk starts 12 + 5k and from there
    assert [(r.first, r.end - r.start, r.key_start) for r in layouts[1].runs] == [
        (2, 2, 0), (8, 2, 0), (16, 4, 12), (28, 4, 12)
    ]  # fmt: skip
    assert [(r.first, r.end - r.start, r.key_start) for r in layouts[1].chunk_runs] == [
        (2, 2, 0), (8, 2, 5), (16, 1, 12), (17, 3, 17), (28, 4, 27)
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a multiple of 2 x cp = 4"):
        partition([8, 6], 2, 0)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One rank's log-probs, checkpoint and first two steps (with the first step's gradients) per model and
    overrides, computed once for the module."""
    cache: dict[tuple, tuple[dict, dict, dict]] = {}

    def get(model: str, extra: list[str]) -> tuple[dict, dict, dict]:
        key = (model, tuple(extra))
        if key not in cache:
            tmp = tmp_path_factory.mktemp("ref")
            spec = {"model": model, "overrides": LR + SINGLE + extra, "save": str(tmp / "ck"), "batch": BATCH}
            (ref,) = _run(tmp, "ref", spec)
            step_spec = {"model": model, "load": str(tmp / "ck" / "step_00000000"), "model_only": True, "steps": 2}
            step_spec.update(grads=True, grads_step=0, batch=BATCH)  # the first step's: Adam magnifies rounding
            (ref_step,) = _run(tmp, "ref_step", {**step_spec, "overrides": LR + SINGLE + extra})
            cache[key] = ref, ref_step, step_spec
        return cache[key]

    return get


def _compare(references, tmp: Path, model: str, layout: list[str], world: int, extra: list[str], spec=None):
    ref, ref_step, step_spec = references(model, extra)
    overrides = LR + SINGLE[:3] + layout + [f"parallel.trainer_devices={world}"] + extra
    ranks = _run(tmp, "cp", {**step_spec, **(spec or {}), "overrides": overrides}, world=world)
    return ref, ref_step, ranks


def _whole_ep_grads(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under the names of one rank: each rank's local experts renamed to their global
    index (EP rank e holds experts e * local .. (e + 1) * local - 1); any other gradient equal on every rank."""
    local = 1 + max(
        (int(n.split(".local_experts.")[1].split(".")[0]) for n in ranks[0]["grads"] if ".local_experts." in n),
        default=-1,
    )
    whole = {}
    for rank in ranks:
        for name, grad in rank["grads"].items():
            if ".local_experts." in name:
                head, tail = name.split(".local_experts.")
                index, rest = tail.split(".", 1)
                whole[f"{head}.local_experts.{rank['ep_rank'] * local + int(index)}.{rest}"] = grad
            elif name in whole:
                torch.testing.assert_close(grad, whole[name], rtol=1e-6, atol=1e-9, msg=name)
            else:
                whole[name] = grad
    return whole


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, layout, world, extra",
    [
        ("cpu_demo", ["parallel.cp=2"], 2, []),
        ("cpu_demo", ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true"], 4, []),
        ("tiny_moe", ["parallel.cp=2", "parallel.ep=2"], 2, []),
        ("tiny_llama4", ["parallel.cp=2", "parallel.ep=2"], 2, LLAMA4_RULES),
        # 1F1B over the CP-split rows with full recompute; GSPO's per-sequence ratio over tokens of both CP ranks
        ("cpu_demo", ["parallel.cp=2", "parallel.pp=2", "trainer.recompute.granularity=full"], 4, []),
        ("cpu_demo", ["parallel.cp=2"], 2, ["algo.loss=gspo", "algo.mismatch_mask=2.0", "algo.tis_cap=2.0"]),
    ],
    ids=["cp2", "cp2_tp2_sp", "moe_cp2_ep2", "llama4_chunks_cp2_ep2", "cp2_pp2_recompute", "cp2_gspo_masked"],
)
def test_context_parallel_equals_one_rank(references, tmp_path, model, layout, world, extra):
    ref, ref_step, ranks = _compare(references, tmp_path, model, layout, world, extra)
    for rank in ranks:
        assert _max_diff(rank["logprobs"], ref["logprobs"]) < 2e-5
        for step, expected in zip(rank["steps"], ref_step["steps"], strict=True):
            assert step["train/loss"] == pytest.approx(expected["train/loss"], rel=5e-5, abs=1e-6)
            assert step["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=5e-5)
        for tokens, padded in rank["rows"]:  # every sequence padded to 2 x cp chunks: each CP rank holds half
            assert padded * 2 > tokens and padded % (2 if "parallel.tp=2" in layout else 1) == 0
    tp = 2 if "parallel.tp=2" in layout else 1
    if "parallel.pp=2" in layout:  # ranks 0, 1: stage 0 (CP ranks 0, 1); ranks 2, 3: stage 1, its layers from 0 again
        grads = dict(ranks[0]["grads"])
        per_stage = 1 + max(int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in grads if "layers." in n)
        for name, grad in ranks[2]["grads"].items():
            layer = re.search(r"layers\.(\d+)\.", name)
            grads[name.replace(layer.group(0), f"layers.{int(layer.group(1)) + per_stage}.") if layer else name] = grad
    elif tp > 1:
        grads = _whole_tp_grads(ranks[:tp])
    else:
        grads = _whole_ep_grads(ranks)
    assert sorted(grads) == sorted(ref_step["grads"])
    for name, grad in ref_step["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name)


@pytest.mark.slow
def test_a_wrong_partition_fails_the_comparison(references, tmp_path):
    """Each rank holding a contiguous half of every sequence (what megatron's RoPE and TE do not expect): the
    positions of the rank's tokens and the keys they see no longer match, and the log-probs move."""
    spec = {"cp_partition": "contiguous", "steps": 0}
    ref, _, ranks = _compare(references, tmp_path, "cpu_demo", ["parallel.cp=2"], 2, [], spec)
    assert _max_diff(ranks[0]["logprobs"], ref["logprobs"]) > 1e-3


@pytest.mark.slow
def test_checkpoints_recompute_and_the_weight_push_under_context_parallel(tmp_path):
    """At CP 2 (with EP 2 on the tiny MoE): a saved run resumes to the bit-identical next step, its checkpoint
    loads into one rank with the same log-probs, selective recompute of core attention (whose exchange then runs
    again in backward) changes nothing, and the weight push hands the engines the same tensors as one rank."""
    layout = ["parallel.cp=2", "parallel.ep=2", "parallel.trainer_devices=2"]
    common = LR + SINGLE[:3] + layout
    full = _run(tmp_path, "full", {"model": "tiny_moe", "overrides": common, "steps": 3, "batch": BATCH,
                                   "save": str(tmp_path / "ck"), "save_after": 2, "push": True}, world=2)  # fmt: skip
    checkpoint = str(tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text())
    resumed = _run(tmp_path, "resumed", {"model": "tiny_moe", "overrides": common, "steps": 1, "batch": BATCH,
                                         "load": checkpoint}, world=2)  # fmt: skip
    for before, after in zip(full, resumed, strict=True):
        assert after["steps"][0] == before["steps"][2]
    (one,) = _run(tmp_path, "one", {"model": "tiny_moe", "overrides": LR + SINGLE, "batch": BATCH, "load": checkpoint,
                                    "model_only": True})  # fmt: skip
    assert _max_diff(one["logprobs"], resumed[0]["logprobs"]) < 2e-5
    recompute = ["trainer.recompute.granularity=selective", "trainer.recompute.modules=[core_attn]"]
    selective = _run(tmp_path, "selective", {"model": "tiny_moe", "overrides": common + recompute, "steps": 3,
                                             "batch": BATCH}, world=2)  # fmt: skip
    for a, b in zip(selective[0]["steps"], full[0]["steps"], strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-6)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-6)
    (pushed,) = _run(tmp_path, "pushed", {"model": "tiny_moe", "overrides": LR + SINGLE, "batch": BATCH, "push": True})
    assert full[0]["push"]["names"] == pushed["push"]["names"] and full[0]["push"]["rounded"]
    assert full[1]["push"]["names"] == []  # every rank takes part in the gathers, rank 0 receives
