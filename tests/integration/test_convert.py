"""Hugging Face <-> Megatron: import into any layout, export back bit for bit, logits equal transformers'."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import _run  # noqa: E402
from trainer_worker import fixed_batch  # noqa: E402

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.convert import dense  # noqa: E402


def test_qkv_split_and_join_are_inverse_with_grouped_heads():
    cfg = load_config("scalerl-cpu", "cpu_demo", []).model  # 4 heads, 2 KV groups, head_dim 32
    qkv = torch.randn((cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim, cfg.hidden_size)
    q, k, v = dense.split_qkv(qkv, cfg)
    assert q.shape[0] == cfg.num_attention_heads * cfg.head_dim and k.shape[0] == cfg.num_query_groups * cfg.head_dim
    # group 0 = rows [q-head 0, q-head 1, k-head 0, v-head 0]
    torch.testing.assert_close(k[: cfg.head_dim], qkv[2 * cfg.head_dim : 3 * cfg.head_dim])
    assert torch.equal(dense.join_qkv(q, k, v, cfg), qkv)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    from megatron_rl.data.tiny import build_tiny_model

    cfg = load_config("scalerl-cpu", "cpu_demo", []).model
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "llama", cfg, seed=3)


def _transformers_logprobs(hf_dir: Path) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = []
    for group in fixed_batch(vocab=512):
        for c in group.completions:
            ids = torch.tensor([c.prompt_tokens + c.tokens])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            out.append([float(logp[i - 1, ids[0, i]]) for i in range(len(c.prompt_tokens), ids.shape[1])])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", [[], ["parallel.tp=2"], ["parallel.pp=2"]], ids=["tp1", "tp2", "pp2"])
def test_llama_import_matches_transformers_and_exports_bit_identically(tmp_path, hf_llama, layout):
    from safetensors.torch import load_file

    world = 2 if layout else 1
    overrides = [*layout, f"parallel.trainer_devices={world}"]
    spec = {"hf": str(hf_llama), "overrides": overrides, "dump_hf": str(tmp_path / "export.pt")}
    result = _run(tmp_path, "convert", spec, world=world)[0]
    exported, original = torch.load(tmp_path / "export.pt"), load_file(hf_llama / "model.safetensors")
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[name], original[name]) for name in original)
    expected = _transformers_logprobs(hf_llama)
    worst = max(
        abs(a - b) for x, y in zip(result["logprobs"], expected, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert worst < 5e-5
