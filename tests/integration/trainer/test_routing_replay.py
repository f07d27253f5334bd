"""Rollout routing replay (trainer/routing.py) on the tiny Qwen3-MoE with real megatron-core.

Every completion of a fixed batch carries a routing record of random experts (distinct per token and layer, so
they differ from the trainer's own choices on most tokens). The reference is transformers' Qwen3-MoE with its
router forced to the recorded experts (gating weights still its own softmax at those experts): an independent
implementation of "route by the recorded choices".
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import _max_diff  # noqa: E402
from test_trainer import _run as trainer_run  # noqa: E402

pytestmark = pytest.mark.slow

SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "parallel.trainer_devices=1"]
LR = ["trainer.optimizer.lr=1e-3", "trainer.optimizer.warmup_steps=0", "trainer.params_dtype=fp32"]


def _run(tmp: Path, name: str, spec: dict, world: int = 1) -> list[dict]:
    """Trainer ranks on the tiny Qwen3-MoE with random generator routing records (seed 7) on every completion."""
    return trainer_run(tmp, name, {"model": "tiny_moe", "routing": 7, **spec}, world)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """The tiny Qwen3-MoE as a transformers checkpoint, and the run config it was built from."""
    from megatron_rl.config import load_config
    from megatron_rl.models.tiny import build_tiny_model

    run = load_config("scalerl-cpu", "tiny_moe", [*SINGLE, "algo.routing_replay=rollout"])
    path = build_tiny_model(tmp_path_factory.mktemp("hf") / "tiny_moe", run.model, seed=3, std=0.2)
    return path, run


class _ForcedRouter(torch.nn.Module):
    """transformers' Qwen3-MoE router with its top-k replaced by given experts (gating: its own softmax there)."""

    def __init__(self, gate: torch.nn.Module) -> None:
        super().__init__()
        self.gate = gate
        self.experts_TK: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor):  # type: ignore[no-untyped-def]
        gate = self.gate
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        assert self.experts_TK is not None
        top = probs.gather(1, self.experts_TK)
        if gate.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), self.experts_TK


def _reference(path: Path, run, batch) -> tuple[list[list[float]], float, float]:
    """transformers routing by the records: log-probs of every completion, and the on-policy CISPO loss (rho = 1)
    with its gradient norm, from the trainer's own advantages and aggregation weights."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.trainer.step import sequences_from_groups

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    routers = []
    for layer in model.model.layers:
        layer.mlp.gate = _ForcedRouter(layer.mlp.gate)
        routers.append(layer.mlp.gate)
    sequences = sequences_from_groups(batch, run)
    logprobs, loss = [], torch.zeros((), dtype=torch.float64)
    for seq in sequences:
        record = torch.from_numpy(seq.routing.astype("int64"))  # [tokens - 1, layers, k]
        last = torch.arange(record.shape[2]).expand(1, record.shape[1], -1)  # the last token predicts nothing
        record = torch.cat([record, last])
        for i, router in enumerate(routers):
            router.experts_TK = record[:, i]
        logits = model(torch.tensor([seq.tokens])).logits[0].float()
        targets = torch.tensor(seq.tokens[seq.num_prompt :])
        logp = torch.log_softmax(logits, -1)[seq.num_prompt - 1 : -1].gather(1, targets[:, None])[:, 0]
        logprobs.append(logp.detach().tolist())
        mask = torch.tensor(seq.loss_mask)
        loss = loss - (seq.weight * seq.advantage * logp[mask]).sum().double()
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return logprobs, float(loss.detach()), float(grad_norm)


def test_replay_routes_by_the_records_in_forward_and_backward(tmp_path, hf_model):
    """With replay, log-probs, the loss and the gradient norm equal transformers routing by the records; without
    it the trainer routes on its own (different log-probs) and its measured agreement with the records is < 1."""
    path, run = hf_model
    base = {"hf": str(path), "dump_batch": str(tmp_path / "batch.pt"), "steps": 1, "on_policy": True}
    (replayed,) = _run(tmp_path, "replay", {**base, "overrides": [*LR, *SINGLE, "algo.routing_replay=rollout"]})
    (measured,) = _run(tmp_path, "measure", {**base, "overrides": [*LR, *SINGLE, "algo.routing_replay=measure"]})
    batch = torch.load(tmp_path / "batch.pt", weights_only=False)
    logprobs, loss, grad_norm = _reference(path, run, batch)

    assert _max_diff(replayed["logprobs"], logprobs) < 2e-5
    step = replayed["step_metrics"][0]
    assert step["train/loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert step["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    # the records are random: the trainer's own routing differs on most tokens, and so do its log-probs
    assert _max_diff(measured["logprobs"], logprobs) > 1e-3
    for result in (replayed, measured):  # replay changes what is used, not what is measured
        agreement = result["routing_agreement"]
        assert 0 < agreement["train/routing_agreement"] < 0.6, agreement
        assert set(agreement) >= {"train/routing_agreement/layer00", "train/routing_agreement/layer01"}
        train_step = result["step_metrics"][0]  # the train step's forward measures the same as compute_logprobs
        assert train_step["train/routing_agreement"] == pytest.approx(agreement["train/routing_agreement"])
    # ... so what was used is logged beside it: every routed token replayed, or none
    for result, share in ((replayed, 1.0), (measured, 0.0)):
        assert result["routing_agreement"]["train/routing_replayed"] == share
        assert result["step_metrics"][0]["train/routing_replayed"] == share


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.ep=2"],
        ["parallel.tp=2", "parallel.sequence_parallel=true"],  # experts whole (etp 1): SP shards of each row
        ["trainer.recompute.granularity=full", "trainer.recompute.method=uniform", "trainer.recompute.num_layers=1"],
        # 1F1B over several micro-batches: each recomputation inside backward pops its own micro-batch's targets
        ["parallel.pp=2", "trainer.recompute.granularity=full", "trainer.recompute.method=uniform"],
        # context parallel: each rank routes its share of every sequence, the experts split over the CP ranks
        ["parallel.cp=2", "parallel.ep=2", "trainer.recompute.granularity=full"],
    ],
    ids=["ep2", "tp2_sp_etp1", "full_recompute", "pp2_1f1b_recompute", "cp2_ep2_recompute"],
)
def test_replay_is_the_same_at_every_layout(tmp_path, hf_model, layout):
    """Expert parallel, sequence-parallel shards and recomputation inside backward (REPLAY_BACKWARD) replay
    exactly what a single rank replays: log-probs, loss and gradient norm of two steps."""
    path, _ = hf_model
    spec = {"hf": str(path), "steps": 2}
    rows = [  # several packed rows per step (the config refuses rows shorter than a rollout's longest sequence)
        "trainer.micro_batch_tokens=48",
        "rollout.max_prompt_tokens=16",
        "rollout.interruption.max_thinking_tokens=8",
        "rollout.interruption.min_thinking_tokens=4",
        "rollout.answer_tokens=8",
    ]
    replay = [*LR, "algo.routing_replay=rollout"]
    (ref,) = _run(tmp_path, "ref", {**spec, "overrides": [*replay, *rows, *SINGLE]})
    world = 1 if layout[0].startswith("trainer.") else 2
    overrides = [*replay, *rows, *SINGLE[:3], f"parallel.trainer_devices={world}", *layout]
    for rank in _run(tmp_path, "par", {**spec, "overrides": overrides}, world=world):
        assert _max_diff(rank["logprobs"], ref["logprobs"]) < 2e-5
        for step, expected in zip(rank["step_metrics"], ref["step_metrics"], strict=True):
            assert step["train/micro_batches"] >= 3
            assert step["train/loss"] == pytest.approx(expected["train/loss"], rel=1e-5, abs=1e-6)
            assert step["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
            assert step["train/routing_agreement"] == pytest.approx(expected["train/routing_agreement"])
            assert step["train/routing_replayed"] == 1.0


REFUSALS = """
import numpy as np, pytest, sys
from megatron_rl.config import load_config
from megatron_rl.rollout.types import random_groups
from megatron_rl.trainer.step import Trainer

run = load_config("scalerl-cpu", "tiny_moe", sys.argv[1:])
trainer = Trainer(run)
batch = random_groups(0, 2, 2, 500, (3, 6), (2, 5))
with pytest.raises(ValueError, match="completion 0 of the batch has no routing record"):
    trainer.train_step(batch)
def records(layers, topk, value):
    for g in batch:
        for c in g.completions:
            c.routed_experts = np.full((len(c.prompt_tokens) + len(c.tokens) - 1, layers, topk), value, np.uint8)
records(2, 3, 0)
with pytest.raises(ValueError, match=r"shape \\[.*, 2, 3\\], expected \\[tokens=.*, layers=2, top-k=2\\]"):
    trainer.train_step(batch)
records(2, 2, 9)
with pytest.raises(ValueError, match=r"expert ids in \\[9, 9\\], the model has 4 experts"):
    trainer.train_step(batch)
records(2, 2, 0)  # SGLang's capture buffer never written: in range, and every token would go to expert 0
with pytest.raises(ValueError, match=r"the batch: every routing record is expert 0 .*--moe-runner-backend,triton"):
    trainer.train_step(batch)
print("refused")
"""


def test_a_missing_or_misshapen_record_stops_the_step():
    """No silently unreplayed step: a completion without a record, or one of the wrong shape or expert ids, is
    refused naming the completion and the field, and a batch of records SGLang never filled in (all expert 0)
    naming the engine flag, before any collective."""
    from megatron_rl.ports import free_port

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-c", REFUSALS, *SINGLE, "algo.routing_replay=rollout"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "refused" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
