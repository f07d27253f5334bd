"""The Megatron-Core trainer: fp32 chunked log-probs, packing, and multi-process runs on CPU with gloo.

Multi-rank checks launch tests/integration/trainer/trainer_worker.py in fresh processes (megatron's parallel state is
process-global); they compare against a TP=1/PP=1/EP=1/DP=1 reference loaded from the same checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.trainer.distributed import process_group_backend, served_device_types
from megatron_rl.trainer.logprobs import naive_token_logprobs, token_logprobs
from megatron_rl.trainer.step import MicroBatch, Sequence, pack, shard_for_rank

WORKER = Path(__file__).with_name("trainer_worker.py")
LR = ["trainer.optimizer.lr=1e-3", "trainer.optimizer.warmup_steps=0"]


# ------------------------------------------------------------------------------------------------
# Log-probs


def test_chunked_logprobs_match_full_softmax_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    upstream = torch.randn(37)

    logprobs, entropy = token_logprobs(hidden, weight, targets, chunk=8)
    (logprobs * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    log_softmax = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
    reference = log_softmax.gather(1, targets[:, None]).squeeze(1)
    (reference * upstream.double()).sum().backward()

    assert logprobs.dtype == torch.float32 and entropy.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), reference, atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), -(log_softmax.exp() * log_softmax).sum(-1), atol=2e-5, rtol=0)
    torch.testing.assert_close(grads[0], hidden.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grads[1], weight.grad, atol=2e-5, rtol=1e-4)


def test_logprobs_are_fp32_for_a_bf16_body_and_fp32_head():
    hidden = torch.randn(5, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float32, requires_grad=True)
    logprobs, _ = token_logprobs(hidden.float(), weight, torch.arange(5), chunk=2)
    logprobs.sum().backward()
    assert logprobs.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert hidden.grad.dtype == torch.bfloat16
    expected, _ = naive_token_logprobs(hidden.float(), weight, torch.arange(5))
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------
# Packing


def _seq(n_prompt: int, n_completion: int, index: int) -> Sequence:
    tokens = list(range(10 * index, 10 * index + n_prompt + n_completion))
    return Sequence(tokens, n_prompt, [0.0] * n_completion, [True] * n_completion, 1.0, 0.1, index)


def test_pack_respects_budget_and_keeps_every_sequence():
    sequences = [_seq(3, n, i) for i, n in enumerate([5, 9, 2, 7, 1, 4])]
    rows = pack(sequences, budget=12)
    assert sorted(s.index for row in rows for s in row) == list(range(6))
    assert all(sum(len(s.tokens) for s in row) <= 12 for row in rows)
    assert sorted(sorted(len(s.tokens) for s in row) for row in rows) == [[4, 8], [5, 7], [10], [12]]
    oversize = pack([_seq(10, 10, 0)], budget=8)
    assert len(oversize) == 1 and len(oversize[0]) == 1  # a long sequence gets its own row


def test_data_parallel_shards_partition_the_batch():
    sequences = [_seq(2, n, i) for i, n in enumerate([5, 9, 2, 7, 1, 4, 3])]
    shards = [shard_for_rank(sequences, 3, r) for r in range(3)]
    assert sorted(s.index for shard in shards for s in shard) == list(range(7))
    loads = [sum(len(s.tokens) for s in shard) for shard in shards]
    assert max(loads) - min(loads) <= 11  # greedy balance: within the longest sequence


def test_micro_batch_is_thd_with_sequence_boundaries_and_padding():
    a, b = _seq(2, 3, 0), _seq(1, 2, 1)
    mb = MicroBatch([a, b])
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    params = mb.packed_seq_params(torch.device("cpu"))
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 5, 8]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == 5
    assert not hasattr(mb, "attention_mask")  # no L x L mask anywhere
    # completion token j of a sequence is predicted by the hidden state just before it
    assert mb.hidden_index_T.tolist() == [1, 2, 3, 5, 6]
    assert mb.targets_T.tolist() == a.tokens[2:] + b.tokens[1:]
    assert mb.seq_index_T.tolist() == [0, 0, 0, 1, 1]

    padded = MicroBatch([a, b], pad_multiple=4)  # sequence parallel over 4 TP ranks: 8 -> 8, 9 -> 12
    assert padded.num_tokens == 8
    odd = MicroBatch([a, b, _seq(1, 0, 2)], pad_multiple=4)
    assert odd.num_tokens == 12 and odd.lengths == [5, 3, 1, 3]  # the padding is a segment of its own
    assert odd.packed_seq_params(torch.device("cpu")).cu_seqlens_q.tolist() == [0, 5, 8, 9, 12]
    assert odd.hidden_index_T.tolist() == [1, 2, 3, 5, 6]  # padding predicts nothing

    chunked = MicroBatch([_seq(2, 9, 0), _seq(1, 3, 1)], chunk_size=4).packed_seq_params(torch.device("cpu"))
    assert chunked.chunk_cu_seqlens.tolist() == [0, 4, 8, 11, 15]  # chunks counted from each sequence's start
    assert chunked.positions.tolist() == list(range(11)) + list(range(4))


def test_a_micro_batch_split_over_context_parallel_ranks_covers_every_token_once():
    """CP 2: each sequence padded to 4 chunks (its own trailing tokens), rank r holding chunks r and 3 - r of every
    segment; the head of each rank predicts the completion tokens whose predicting hidden state it holds, and the
    ranks' shares in `cp_order` are every completion token exactly once."""
    a, b = _seq(2, 5, 0), _seq(3, 2, 1)  # 7 and 5 tokens -> 8 and 8
    ranks = [MicroBatch([a, b], pad_multiple=4, seq_pad_multiple=4, cp=2, cp_rank=r) for r in range(2)]
    assert ranks[0].lengths == [8, 8] and ranks[0].row_tokens == 16
    assert ranks[0].input_ids.tolist() == [a.tokens[0:2] + [a.tokens[6], 0] + b.tokens[0:2] + [0, 0]]  # chunks 0, 3
    assert ranks[1].input_ids.tolist() == [a.tokens[2:6] + b.tokens[2:5] + [0]]  # chunks 1 and 2
    assert ranks[0].position_ids.tolist() == [[0, 1, 6, 7, 0, 1, 6, 7]]
    params = ranks[1].packed_seq_params(torch.device("cpu"))
    assert params.cu_seqlens_q.tolist() == [0, 8, 16] and params.cu_seqlens_q_padded.tolist() == [0, 8, 16]
    # a's completion is predicted from row positions 1-5 (rank 0 holds 1, rank 1 2-5), b's from 10-11 (rank 1)
    assert ranks[0].cp_counts == ranks[1].cp_counts == [1, 6]
    assert sorted(ranks[0].cp_order.tolist()) == list(range(7))
    for rank in ranks:  # the targets a rank's head predicts, from its own hidden rows
        mine = rank.cp_order[sum(rank.cp_counts[: rank.cp_rank]) :][: rank.cp_counts[rank.cp_rank]]
        assert rank.head_targets_T.tolist() == rank.targets_T[mine].tolist()
        row = rank.cp_index[rank.head_index_T]  # the row positions of those hidden states
        assert row.tolist() == rank.hidden_index_T[mine].tolist()


def test_pack_counts_padding_against_the_budget():
    sequences = [_seq(2, 3, i) for i in range(3)]  # 5 tokens each
    assert len(pack(sequences, budget=10)) == 2  # 5 + 5 fits exactly
    assert len(pack(sequences, budget=10, pad_multiple=4)) == 3  # 5 + 5 pads to 12 > 10


# ------------------------------------------------------------------------------------------------
# Megatron-Core on CPU: the compatibility layer's canary


def test_cpu_compat_symbols_exist():
    from megatron_rl.trainer import cpu_compat

    cpu_compat.check_symbols()  # raises naming what an upgrade removed


class _Group:
    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize(
    "lengths, cp, interleaved",
    [([7, 1, 30, 12], 1, False), ([5, 64, 2], 1, True), ([8, 4, 20], 2, False), ([12, 24, 36], 3, False)],
)
def test_cpu_thd_rope_equals_megatrons_per_sequence_loop(lengths, cp, interleaved):
    """The CPU THD RoPE (cpu_compat patch 6) gives megatron's per-sequence loop bit for bit, values and
    gradients, on every CP rank's share of packed sequences of odd lengths."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl.trainer import cpu_compat

    cpu_compat.apply()
    patched = rope_utils._apply_rotary_pos_emb_thd
    original = patched.megatron_rl_original
    g = torch.Generator().manual_seed(sum(lengths) + cp)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    dim = 16
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(max(lengths), dtype=torch.float32), inv)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    for rank in range(cp):
        t = torch.randn(sum(lengths) // cp, 4, dim + 4, generator=g)  # 4 channels past the rotary dimension
        grad = torch.randn(t.shape, generator=g)
        outs = []
        for fn in (original, patched):
            x = t.clone().requires_grad_(True)
            out = fn(x, cu_seqlens, freqs, rotary_interleaved=interleaved, cp_group=_Group(cp, rank))
            out.backward(grad)
            outs.append((out.detach(), x.grad))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # positions, as TE's THD split assigns them: rank 1 of 2 holds chunks 1 and 2 of each 2 x 2-chunk sequence
    assert cpu_compat.thd_positions(torch.tensor([0, 8, 12]), 2, 1).tolist() == [2, 3, 4, 5, 1, 2]


# ------------------------------------------------------------------------------------------------
# Multi-process runs


def _run(tmp: Path, name: str, spec: dict, world: int = 1) -> list[dict]:
    from megatron_rl.ports import free_port

    spec = {"model": "cpu_demo", "out": str(tmp / name), **spec}
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(spec)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [p.communicate(timeout=300)[0] for p in procs]
    except subprocess.TimeoutExpired:
        # a rank that died leaves its peers waiting in a collective: end them all and show every rank's output
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
        raise AssertionError("\n".join(f"rank {r} ({p.returncode}): {out[-3000:]}" for r, (p, out) in
                                        enumerate(zip(procs, outputs, strict=True)))) from None  # fmt: skip
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return [torch.load(f"{spec['out']}.rank{r}", weights_only=False) for r in range(world)]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE, non-interleaved halves (x: [seq, heads, head_dim])."""
    seq, _, dim = x.shape
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + half * sin


def _plain_llama_logprobs(state: dict, tokens: list[int], num_prompt: int, cfg) -> list[float]:
    """An independent float64 Llama forward from megatron's parameter names and layouts."""
    heads, groups, dim = cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim
    x = state["embedding.word_embeddings.weight"].double()[torch.tensor(tokens)]
    n = len(tokens)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(cfg.num_layers):
        p = {k.split(f"decoder.layers.{layer}.", 1)[1]: v.double() for k, v in state.items() if f"layers.{layer}." in k}
        h = _rms_norm(x, p["input_layernorm.weight"], cfg.norm_epsilon)
        qkv = (h @ p["self_attention.linear_qkv.weight"].t()).view(n, groups, heads // groups + 2, dim)
        q = qkv[:, :, :-2].reshape(n, heads, dim)
        k = qkv[:, :, -2].repeat_interleave(heads // groups, dim=1)
        v = qkv[:, :, -1].repeat_interleave(heads // groups, dim=1)
        q, k = _rotate(q, cfg.rotary_base), _rotate(k, cfg.rotary_base)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
        attn = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        x = (
            x
            + torch.einsum("hqk,khd->qhd", attn, v).reshape(n, heads * dim) @ p["self_attention.linear_proj.weight"].t()
        )
        h = _rms_norm(x, p["pre_mlp_layernorm.weight"], cfg.norm_epsilon)
        gate, up = (h @ p["mlp.linear_fc1.weight"].t()).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ p["mlp.linear_fc2.weight"].t()
    x = _rms_norm(x, state["decoder.final_layernorm.weight"].double(), cfg.norm_epsilon)
    logp = torch.log_softmax(x @ state["output_layer.weight"].double().t(), -1)
    return [float(logp[i - 1, tokens[i]]) for i in range(num_prompt, n)]


@pytest.mark.slow
def test_megatron_logprobs_equal_an_independent_torch_forward(tmp_path):
    from megatron_rl.config import load_config

    (result,) = _run(tmp_path, "ref", {"overrides": LR, "dump_state": str(tmp_path / "state.pt")})
    dumped = torch.load(tmp_path / "state.pt", weights_only=False)
    cfg = load_config("scalerl-cpu", "cpu_demo", []).model
    expected = [
        _plain_llama_logprobs(dumped["state"], c.prompt_tokens + c.tokens, len(c.prompt_tokens), cfg)
        for g in dumped["batch"]
        for c in g.completions
    ]
    assert _max_diff(result["logprobs"], expected) < 2e-5


@pytest.mark.slow
def test_bf16_body_keeps_an_fp32_head_and_cispo_lowers_the_loss(tmp_path):
    (result,) = _run(tmp_path, "bf16", {"overrides": [*LR, "trainer.params_dtype=bf16"], "steps": 4, "on_policy": True})
    assert result["body_dtype"] == "torch.bfloat16"
    assert result["head_dtype"] == "torch.float32" and result["head_grad_dtype"] == "torch.float32"
    losses = [s["train/loss"] for s in result["steps"]]
    assert losses[-1] < losses[0] - 0.3, losses  # on-policy CISPO loss = -sum w A log pi: it must go down
    assert all(s["train/mismatch"] < 1e-2 for s in result["steps"])  # bf16 body, fp32 head and log-probs


@pytest.mark.slow
def test_tied_embeddings_keep_an_fp32_head_under_a_bf16_body(tmp_path):
    """Qwen3 with tied embeddings (qwen3_4b's layout): the shared weight is fp32 for the head, the embedding's
    output enters the bf16 body as bf16, and the step trains."""
    spec = {"model": "tiny_qwen3", "overrides": [*LR, "trainer.params_dtype=bf16"], "steps": 4, "on_policy": True}
    (result,) = _run(tmp_path, "tied", spec)
    assert result["body_dtype"] == "torch.bfloat16" and result["head_dtype"] == "torch.float32"
    losses = [s["train/loss"] for s in result["steps"]]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(s["train/mismatch"] < 1e-2 for s in result["steps"])


@pytest.mark.slow
def test_weight_push_gives_rank_0_the_engines_dtype_and_the_other_ranks_nothing(tmp_path):
    """TP 2, bf16 body, fp32 head: the push stream reaches rank 0 only, every tensor in the engines' bf16 (the
    fp32 head rounded as the engine would round it on copy, at half the bytes); rank 1 builds no bucket."""
    overrides = [*LR, "trainer.params_dtype=bf16", "parallel.tp=2", "parallel.trainer_devices=2"]
    rank0, rank1 = _run(tmp_path, "push", {"overrides": overrides, "push": True}, world=2)
    assert rank0["push"]["names"] == sorted(rank0["push"]["full_dtypes"]) and rank0["push"]["dtypes"] == [
        "torch.bfloat16"
    ]
    assert rank0["push"]["full_dtypes"]["lm_head.weight"] == "torch.float32" and rank0["push"]["rounded"]
    assert rank1["push"]["names"] == [] and rank1["push"]["full_dtypes"] == rank0["push"]["full_dtypes"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, world",
    [
        ([], 1),
        # the GPU default: a bf16 body with the FP32 LM head in one parameter group, the distributed optimizer
        # sharded over DP 2 (trainer/optimizer.py, gap 1); and the same with half the Adam state offloaded
        (["trainer.params_dtype=bf16", "parallel.trainer_devices=2"], 2),
        (["trainer.params_dtype=bf16", "parallel.trainer_devices=2", "trainer.optimizer.cpu_offload=true",
          "trainer.optimizer.offload_fraction=0.5"], 2),
    ],
    ids=["fp32", "bf16_fp32_head_dp2", "bf16_fp32_head_dp2_offload"],
)  # fmt: skip
def test_resume_gives_the_bit_identical_next_steps(tmp_path, overrides, world):
    """Two steps after a resume are those of the uninterrupted run, bit for bit: the first step's loss depends only on
    the loaded weights, the second's on the first update too (Adam's moments and step counts, trainer/optimizer.py
    gap 6), as do the final weights."""
    spec = {"overrides": LR + overrides, "steps": 4, "save": str(tmp_path / "ck"), "save_after": 2}
    (full, *_) = _run(tmp_path, "full", {**spec, "dump_final": str(tmp_path / "full_params")}, world=world)
    checkpoint = tmp_path / "ck" / (tmp_path / "ck" / "latest").read_text()
    resume = {"overrides": LR + overrides, "steps": 2, "load": str(checkpoint)}
    (resumed, *_) = _run(tmp_path, "resumed", {**resume, "dump_final": str(tmp_path / "resumed_params")}, world)
    assert resumed["steps"] == full["steps"][2:]  # loss, grad norm and mismatch, bit for bit
    for rank in range(world):
        final = torch.load(tmp_path / f"full_params.rank{rank}", weights_only=False)
        again = torch.load(tmp_path / f"resumed_params.rank{rank}", weights_only=False)
        for name in (n for n in final if "_extra_state" not in n):
            assert torch.equal(final[name], again[name]), name
    assert full["save_children"] == []  # megatron's default results queue spawned a ~0.3 GB Manager process


SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.trainer_devices=1"]


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    """`single_rank(model)`: one rank's log-probs at the initial weights (saved as a checkpoint), and its two steps
    from that checkpoint with every gradient; run once per model for the layouts compared with it."""
    cache: dict[str, tuple[dict, dict, str]] = {}

    def reference(model: str) -> tuple[dict, dict, str]:
        if model not in cache:
            tmp = tmp_path_factory.mktemp(f"single_{model}")
            (ref,) = _run(tmp, "ref", {"model": model, "overrides": LR + SINGLE, "save": str(tmp / "ck")})
            checkpoint = str(tmp / "ck" / "step_00000000")
            step_spec = {"model": model, "load": checkpoint, "model_only": True, "steps": 2, "grads": True}
            (ref_step,) = _run(tmp, "ref_step", {**step_spec, "overrides": LR + SINGLE})
            cache[model] = ref, ref_step, checkpoint
        return cache[model]

    return reference


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, layout",
    [
        ("cpu_demo", ["parallel.tp=2"]),
        ("cpu_demo", ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("cpu_demo", ["parallel.pp=2"]),
        ("cpu_demo", []),  # DP=2 with the distributed optimizer
        ("tiny_moe", ["parallel.ep=2"]),
        ("tiny_moe", ["parallel.tp=2", "parallel.sequence_parallel=true"]),  # experts whole (etp 1), DP 2 for them
        ("tiny_moe", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=2"]),
    ],
    ids=["tp2", "tp2_sp", "pp2", "dp2", "ep2", "moe_tp2_sp", "moe_tp2_sp_etp2"],
)
def test_parallel_layouts_match_a_single_rank(tmp_path, single_rank, model, layout):
    """Log-probs, and loss and gradient norm of two steps (the second sees the first step's whole gradient
    through Adam), on packed rows of odd lengths (sequence parallel pads them). For dense TP alone (every
    rank holds TP shards of the whole model), also every parameter's gradient of the second step."""
    tp_only = model == "cpu_demo" and "parallel.tp=2" in layout
    ref, ref_step, checkpoint = single_rank(model)
    step_spec = {"model": model, "load": checkpoint, "model_only": True, "steps": 2, "grads": tp_only}
    overrides = LR + SINGLE[:3] + layout + ["parallel.trainer_devices=2"]
    ranks = _run(tmp_path, "par", {**step_spec, "overrides": overrides}, world=2)
    for rank in ranks:
        assert _max_diff(rank["logprobs"], ref["logprobs"]) < 2e-5
        for step, expected in zip(rank["steps"], ref_step["steps"], strict=True):
            assert step["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5, abs=1e-6)
            assert step["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    if "parallel.sequence_parallel=true" in layout:
        assert any(tokens % 2 for tokens, _ in ranks[0]["rows"]), ranks[0]["rows"]  # a row padded for SP
        assert all(padded % 2 == 0 for _, padded in ranks[0]["rows"]), ranks[0]["rows"]
    if tp_only:
        whole = _whole_tp_grads(ranks)
        assert sorted(whole) == sorted(ref_step["grads"])
        for name, grad in ref_step["grads"].items():
            torch.testing.assert_close(whole[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name)


@pytest.fixture(scope="module")
def trained_single_rank(tmp_path_factory, trained_policy):
    """One rank's two on-policy steps from the trained policy's Hugging Face checkpoint."""
    spec = {"hf": str(trained_policy), "steps": 2, "on_policy": True, "overrides": LR + SINGLE}
    return _run(tmp_path_factory.mktemp("trained_single"), "ref", spec)[0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.cp=2"]],
    ids=["tp2_sp", "cp2"],
)
def test_layouts_from_the_trained_policy_match_a_single_rank(tmp_path, trained_policy, trained_single_rank, layout):
    """The layouts users train the CPU policy with, started from its Hugging Face checkpoint (trained weights, whose
    log-probs are peaked, not a random model's near-uniform ones): each rank imports its shards, and log-probs, loss
    and gradient norm of two on-policy steps equal one rank's."""
    spec = {"hf": str(trained_policy), "steps": 2, "on_policy": True}
    ref = trained_single_rank
    ranks = _run(tmp_path, "par", {**spec, "overrides": LR + SINGLE[:3] + layout + ["parallel.trainer_devices=2"]}, 2)
    assert ref["steps"][0]["train/loss"] != 0.0 and ref["steps"][1]["train/loss"] != ref["steps"][0]["train/loss"]
    for rank in ranks:
        assert _max_diff(rank["logprobs"], ref["logprobs"]) < 2e-5
        for step, expected in zip(rank["steps"], ref["steps"], strict=True):
            assert step["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5, abs=1e-6)
            assert step["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)


def _whole_tp_grads(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Full gradients from the gradients of TP ranks 0..n-1 (one data-parallel rank): a TP-split parameter's
    shards joined along its split dimension (SwiGLU's fc1 shard r is [gate_r; up_r]); any other parameter's
    gradient is the same on every rank (the sequence-parallel norms' partial gradients summed over TP)."""
    whole = {}
    for name, grad in ranks[0]["grads"].items():
        shards = [rank["grads"][name] for rank in ranks]
        dim = ranks[0]["tp_dims"].get(name)
        if dim is None:
            for shard in shards[1:]:
                torch.testing.assert_close(shard, grad, rtol=1e-6, atol=1e-9, msg=name)
            whole[name] = grad
        elif name.endswith("linear_fc1.weight"):
            halves = [shard.chunk(2, dim) for shard in shards]
            whole[name] = torch.cat([gate for gate, _ in halves] + [up for _, up in halves], dim)
        else:
            whole[name] = torch.cat(shards, dim)
    return whole


ATTENTION, MLP, MOE = "Attention._checkpointed_attention_forward", "TransformerLayer._forward_mlp", "MoELayer.forward"
LAYERS = "checkpointed_forward.<locals>.chunk_runner"  # TransformerBlock's full recompute, one call per group


def _recompute_single(model: str) -> list[str]:
    single = ["parallel.ep=1", "parallel.trainer_devices=1"]
    if model == "tiny_llama4":  # recompute through the chunked and temperature-tuned attention too
        single += ["model.attention_chunk_size=4", "model.attn_temperature_tuning=true", "model.floor_scale=4"]
    return single


@pytest.fixture(scope="module")
def without_recompute(tmp_path_factory):
    """`without_recompute(model)`: one step without recompute, with its gradients; run once per model."""
    cache: dict[str, dict] = {}

    def plain(model: str) -> dict:
        if model not in cache:
            spec = {"model": model, "steps": 1, "grads": True, "record_checkpoints": True}
            tmp = tmp_path_factory.mktemp(f"plain_{model}")
            cache[model] = _run(tmp, "plain", {**spec, "overrides": LR + _recompute_single(model)})[0]
        return cache[model]

    return plain


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, recompute, checkpointed",
    [
        (
            "cpu_demo",
            ["trainer.recompute.granularity=selective", "trainer.recompute.modules=[core_attn,mlp]"],
            {ATTENTION: 4, MLP: 4},
        ),
        ("cpu_demo", ["trainer.recompute.granularity=full", "trainer.recompute.method=uniform"], {LAYERS: 4}),
        ("cpu_demo", ["trainer.recompute.granularity=full", "trainer.recompute.method=block"], {LAYERS: 1}),
        (
            "tiny_llama4",
            ["trainer.recompute.granularity=selective", "trainer.recompute.modules=[core_attn,moe]"],
            {ATTENTION: 2, MOE: 2},
        ),
        ("tiny_llama4", ["trainer.recompute.granularity=full", "trainer.recompute.num_layers=2"], {LAYERS: 1}),
    ],
    ids=["selective", "full_uniform", "full_block", "moe_selective", "moe_full_2_layers"],
)
def test_recompute_gives_identical_loss_and_gradients(tmp_path, without_recompute, model, recompute, checkpointed):
    """Same loss and gradients with recompute; and the recompute ran: megatron's activation checkpoint wrapped
    the configured parts (per micro-batch: each layer's attention / MLP / MoE, or one call per group of
    layers) in the forward of the step, and recomputed each of them in its backward."""
    spec = {"model": model, "steps": 1, "grads": True, "record_checkpoints": True}
    plain = without_recompute(model)
    (again,) = _run(tmp_path, "again", {**spec, "overrides": LR + _recompute_single(model) + recompute})
    assert again["steps"] == plain["steps"]  # loss, grad norm, mismatch
    assert sorted(again["grads"]) == sorted(plain["grads"])
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(again["grads"][name], grad, rtol=1e-6, atol=1e-8, msg=name)

    assert plain["checkpoints"][1] == {"forward": {}, "backward": {}}
    micro_batches = len(again["micro_batches"])
    expected = {by: count * micro_batches for by, count in checkpointed.items()}
    assert again["checkpoints"][1] == {"forward": expected, "backward": expected}


def _illegal_on_a_gpu_node(calls: set[tuple[str, str, str]], trainer_device: str, default: str) -> list[tuple]:
    """The (collective, group backend, device type) calls of a CPU run that would fail on a GPU node, where the
    default group is built with backend `default` and the trainer's device is CUDA.

    A group inherits the default group's backend unless its constructor named one (megatron's gloo groups).
    A tensor on the trainer's device here is on CUDA there, unless it is bookkeeping the trainer keeps on CPU;
    on CPU the two cannot be told apart, so such a tensor must be served on both."""
    illegal = []
    for name, backend, device in sorted(calls):
        there = {"cpu", "cuda"} if device == trainer_device else {device}
        if not there <= served_device_types(default if backend == "default" else backend):
            illegal.append((name, backend, device))
    return illegal


@pytest.mark.slow
def test_trainer_collectives_only_pass_tensors_the_gpu_process_groups_serve(tmp_path):
    """Every tensor any collective receives in a step (ours and megatron's: MoE dispatch, sequence parallel,
    gradient reduction, metric sums) must be of a device type that its group's backend serves on a GPU node.
    The bookkeeping is on CPU: a NCCL-only group (torch: "No backend type associated with device type cpu")
    would fail, the trainer's "cpu:gloo,cuda:nccl" serves it."""
    overrides = LR + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.trainer_devices=2"]
    spec = {"model": "tiny_moe", "overrides": overrides, "steps": 1, "record_collectives": True}
    for rank in _run(tmp_path, "collectives", spec, world=2):
        calls, device = rank["collectives"]["calls"], rank["device"]
        assert rank["collectives"]["default"] == process_group_backend(cuda=False) and device == "cpu"
        names = {name for name, _, _ in calls}
        assert {"all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"} <= names, calls
        assert any(backend == "default" for _, backend, _ in calls)  # megatron's groups inherit the default's
        assert _illegal_on_a_gpu_node(calls, device, process_group_backend(cuda=True)) == []
        # The check can fail: an NCCL-only default group refuses the CPU bookkeeping (and all a CPU run sees).
        assert ("all_reduce", "default", "cpu") in _illegal_on_a_gpu_node(calls, device, "nccl")


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """DP 2: a NaN in one rank's gradients at the second of three steps. Both ranks skip that step (weights
    unchanged, version not advanced, counted), then train on: one vote over the trainer, not per rank."""
    spec = {"overrides": LR + ["parallel.trainer_devices=2"], "steps": 3, "nan_grad": [1, 1]}
    for rank in _run(tmp_path, "nan", spec, world=2):
        steps = rank["steps"]
        assert [s["train/skipped_steps"] for s in steps] == [0.0, 1.0, 1.0]
        assert rank["versions"] == [1, 1, 2]
        assert rank["weights"][1] == rank["weights"][0] != rank["weights"][2]
        assert math.isnan(steps[1]["train/grad_norm"]) and math.isfinite(steps[2]["train/grad_norm"])
        assert math.isfinite(steps[1]["train/loss"])  # the loss was fine: the gradient alone skips the step


def test_a_sequence_longer_than_a_micro_batch_stops_before_any_collective(tmp_path):
    overrides = [*LR, "trainer.micro_batch_tokens=512"]
    batch = {"completion_len": [600, 601]}
    spec = {"model": "cpu_demo", "overrides": overrides, "batch": batch, "out": str(tmp_path / "x")}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(spec)], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "trainer.micro_batch_tokens: a sequence of" in proc.stdout + proc.stderr
    assert "does not fit a micro-batch of 512 tokens" in proc.stdout + proc.stderr


REPLAY = "algo.routing_replay=rollout"
ENVIRONMENT_LAYOUTS = {  # model, layout, generator routing records (seed), from the trained policy, ranks
    "single": ("cpu_demo", [], None, False, 1),
    "cp2_trained": ("cpu_demo", ["parallel.cp=2", "parallel.trainer_devices=2"], None, True, 2),
    "moe_ep2_replay": ("tiny_moe", ["parallel.ep=2", "parallel.trainer_devices=2", REPLAY], 3, False, 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(ENVIRONMENT_LAYOUTS))
def test_environment_tokens_carry_no_loss(tmp_path, request, layout):
    """A tool's response is context, not something the policy is trained to say: with every completion holding two
    environment segments (one between policy turns, one at the end), changing their generator log-probs, their
    versions and the trailing segment's ids leaves every gradient as it was; changing one policy token's
    generator log-prob does not (the check can fail). Alone, and composed as tool runs train: context parallel
    (the segments split across ranks) from the trained policy, and MoE at EP 2 replaying the generator's routing."""
    model, overrides, routing, trained, world = ENVIRONMENT_LAYOUTS[layout]
    spec = {"model": model, "steps": 1, "grads": True, "overrides": LR + overrides, "routing": routing}
    if trained:
        spec["hf"] = str(request.getfixturevalue("trained_policy"))
    plain = _run(tmp_path, "plain", {**spec, "environment": None}, world)
    environment = _run(tmp_path, "env", {**spec, "environment": "environment"}, world)
    for rank, (ours, theirs) in enumerate(zip(environment, plain, strict=True)):
        assert ours["steps"][0]["train/loss"] == theirs["steps"][0]["train/loss"], rank
        assert theirs["grads"], rank
        for name, grad in theirs["grads"].items():
            torch.testing.assert_close(ours["grads"][name], grad, rtol=1e-6, atol=1e-9, msg=f"rank {rank}: {name}")
    if layout == "single":  # the control: the comparison sees a change in what is trained on
        (policy,) = _run(tmp_path, "policy", {**spec, "environment": "policy"})
        grads = plain[0]["grads"]
        assert any(not torch.allclose(policy["grads"][n], g, rtol=1e-4, atol=1e-8) for n, g in grads.items())
