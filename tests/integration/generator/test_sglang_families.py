"""SGLang on CPU serves every model family the trainer trains, as transformers computes it.

For the tiny Qwen3, Qwen3-MoE and Llama-4 (the dense Llama is tests/integration/generator/test_sglang_engine.py):
the served log-probs of sampled completions equal transformers' forward on the same tokens (both fp32), and for the MoE
families the routing records SGLang returns (`--enable-return-routed-experts`, what rollout routing replay
trains on) are the experts transformers' routers choose for the same tokens. The weights are redrawn with a
large spread (`build_tiny_model(std=...)`), so a weight SGLang loads wrongly or not at all changes the log-probs
by far more than the bounds. Llama-4 needs the project's SGLang CPU layer (tools/sglang_cpu: attention in the
model's dtype, transformers' RoPE layout and NoPE layers, the fused expert weights loaded, input-side router
weights in the CPU MoE).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from megatron_rl.config import SamplingConfig, load_config
from megatron_rl.generator.client import SGLangClient
from megatron_rl.generator.server import SGLangServer
from megatron_rl.rollout.types import RoutingShape

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 99], [7, 8, 9], [100, 200, 300, 400, 12], [33]]
MEAN_BOUND, MAX_BOUND = 1e-5, 1e-4  # as test_sglang_engine.py: fp32 on both sides


def _hf_forward(model, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Log-softmax over the vocabulary at every position, and each MoE layer's router logits [tokens, experts]."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    logits = [r.reshape(len(ids), -1) for r in (getattr(out, "router_logits", None) or ())]
    return torch.log_softmax(out.logits[0].double(), -1), logits


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_moe", "tiny_llama4"])
def test_served_logprobs_and_routing_equal_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.tiny import build_tiny_model

    run = load_config("scalerl-cpu", name, [])
    path = build_tiny_model(tmp_path / name, run.model, seed=5, std=0.2)
    moe = run.model.moe if run.model.is_moe else None
    shape = RoutingShape(run.model.num_layers, moe.router_topk, moe.num_experts) if moe is not None else None
    engine = run.rollout.engine
    if shape is not None:
        engine = dataclasses.replace(engine, extra_args=["--enable-return-routed-experts"])
    server = SGLangServer(path, engine, tmp_path / "engine.log", max_total_tokens=4096)
    server.start()

    async def generate():
        await server.wait_ready(timeout_s=400)
        client = SGLangClient(server.url, routing=shape)
        try:
            sampling = SamplingConfig(temperature=1.0, top_p=1.0)
            return await asyncio.gather(*(client.generate(p, 24, [], sampling, {"ignore_eos": True}) for p in PROMPTS))
        finally:
            await client.close()

    try:
        segments = asyncio.run(generate())
    finally:
        server.stop()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    diffs, matched, routed = [], 0, 0
    for prompt, segment in zip(PROMPTS, segments, strict=True):
        ids = prompt + segment.tokens
        logp, router_logits = _hf_forward(model, ids)
        positions = torch.arange(len(prompt) - 1, len(ids) - 1)
        expected = logp[positions, torch.tensor(segment.tokens)]
        diffs.append((torch.tensor(segment.logprobs).double() - expected).abs())
        if shape is not None:
            assert segment.routing is not None and segment.routing.shape == (len(ids) - 1, shape.layers, shape.topk)
            assert len(router_logits) == shape.layers
            for layer, logits in enumerate(router_logits):
                own = logits[:-1].topk(shape.topk, dim=-1).indices.sort(-1).values
                served = torch.from_numpy(segment.routing[:, layer].astype("int64")).sort(-1).values
                matched += int((own == served).all(-1).sum())
                routed += len(own)
    diff = torch.cat(diffs)
    print(f"\n{name}: served vs transformers log-prob |diff| mean {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.mean() < MEAN_BOUND and diff.max() < MAX_BOUND
    if shape is not None:
        print(f"{name}: routing agreement with transformers {matched / routed:.4f} of {routed} token-layers")
        assert matched / routed > 0.99
