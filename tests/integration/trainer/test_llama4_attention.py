"""Llama-4's chunked local attention and attention-temperature tuning in the trainer, against transformers.

A tiny Llama-4 (layer 0: RoPE + chunked attention, layer 1: NoPE + temperature tuning, routed + shared
experts) with `attention_chunk_size=8` and `floor_scale=16`: sequences of 40-100 tokens cross several chunks
and several temperature steps. The trainer packs several of them per row (THD, cu_seqlens); transformers'
`Llama4ForCausalLM` runs each sequence on its own. Log-probs of every completion token must agree within
1e-5 at TP1, TP2 with sequence parallel, EP2 and PP2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import _max_diff, _run  # noqa: E402

RULES = [
    "model.attention_chunk_size=8",
    "model.attn_temperature_tuning=true",
    "model.floor_scale=16",
    "model.attn_scale=0.5",
    "model.max_position_embeddings=256",
    "trainer.micro_batch_tokens=512",  # the batch below in two rows
]
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.trainer_devices=1"]
# Two packed rows (6 and 3 sequences) of odd lengths, 477 and 173 tokens: at TP2 with sequence parallel each
# gets a padding segment of one token, and the padding goes through the chunked attention too.
BATCH = {"prompts": 3, "group": 3, "prompt_len": [15, 30], "completion_len": [25, 70], "seed": 5}
LAYOUTS = {
    "tp1": SINGLE,
    "tp2_sp": SINGLE[:3] + ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.trainer_devices=2"],
    "ep2": SINGLE[:3] + ["parallel.ep=2", "parallel.trainer_devices=2"],
    "pp2": SINGLE[:3] + ["parallel.pp=2", "parallel.trainer_devices=2"],
}


def _hf_logprobs(hf_dir: Path, batch: list) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for group in batch:
            for c in group.completions:
                tokens = list(c.prompt_tokens) + list(c.tokens)
                logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)
                out.append([float(logp[i - 1, tokens[i]]) for i in range(len(c.prompt_tokens), len(tokens))])
    return out


@pytest.fixture(scope="module")
def scout_like(tmp_path_factory):
    """A tiny HF Llama-4 with the chunk/temperature rules, the batch, and transformers' log-probs."""
    from megatron_rl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("llama4")
    cfg = load_config("scalerl-cpu", "tiny_llama4", RULES).model
    hf_dir = build_tiny_model(root / "hf", cfg, seed=5, std=0.2)
    (result,) = _run(
        root,
        "probe",
        {"model": "tiny_llama4", "overrides": RULES + SINGLE, "hf": str(hf_dir), "batch": BATCH,
         "dump_batch": str(root / "batch.pt")},
    )  # fmt: skip
    batch = torch.load(root / "batch.pt", weights_only=False)
    lengths = [len(c.prompt_tokens) + len(c.tokens) for g in batch for c in g.completions]
    assert min(lengths) >= 40 and max(lengths) <= 100
    return root, hf_dir, batch, _hf_logprobs(hf_dir, batch)


def test_the_rules_change_transformers_log_probs(scout_like, tmp_path):
    """The comparison can fail: without the rules transformers' log-probs move by far more than 1e-5."""
    from megatron_rl.models.tiny import build_tiny_model

    _, _, batch, expected = scout_like
    plain = load_config("scalerl-cpu", "tiny_llama4", ["model.max_position_embeddings=256"]).model
    plain_dir = build_tiny_model(tmp_path / "plain", plain, seed=5, std=0.2)  # same seed: same weights
    assert _max_diff(_hf_logprobs(plain_dir, batch), expected) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_log_probs_equal_transformers_llama4(scout_like, layout):
    root, hf_dir, _, expected = scout_like
    world = 1 if layout == "tp1" else 2
    spec = {"model": "tiny_llama4", "overrides": RULES + LAYOUTS[layout], "hf": str(hf_dir), "batch": BATCH}
    ranks = _run(root, layout, spec, world=world)
    for rank in ranks:
        rows = rank["micro_batches"]
        assert max(rows) >= 3, f"{layout}: expected several sequences per packed row, got {rows}"
        if layout == "tp2_sp":
            assert all(tokens % 2 for tokens, _ in rank["rows"]), rank["rows"]  # each row padded for SP
            assert all(padded == tokens + 1 for tokens, padded in rank["rows"]), rank["rows"]
        assert _max_diff(rank["logprobs"], expected) < 1e-5
