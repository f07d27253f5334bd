"""The cost model (scaling/cost.py): parameter counts against transformers' own models, the trainer's FLOPs and
the decode time against hand counts, the overlap of the two pipeline modes, `plan --sweep` and `plan --calibrate`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import transformers

from megatron_rl.cli import main
from megatron_rl.config import load_config, save_config
from megatron_rl.models import family
from megatron_rl.scaling.cost import GPUS, Efficiency, calibrate, parameters, step_cost


@pytest.mark.parametrize("name", ["llama3_8b", "qwen3_8b", "qwen3_30b_a3b", "llama4_scout_17bx16e"])
def test_parameter_counts_match_the_transformers_models(name):
    model = load_config("scalerl", name).model
    hf = family(model.family).hf_config(model)
    with torch.device("meta"):
        if model.family == "llama4":
            built = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**hf.get("text_config", hf)))
        else:
            built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
    count = sum(p.numel() for p in built.parameters())
    assert parameters(model).total == pytest.approx(count, rel=1e-4)  # norms left out


def test_active_parameters_count_the_routed_experts_a_token_uses():
    scout = parameters(load_config("scalerl", "llama4_scout_17bx16e").model)
    assert 16e9 < scout.active < 17.5e9 < 100e9 < scout.total  # "17B active, 109B total"
    qwen = parameters(load_config("scalerl", "qwen3_30b_a3b").model)
    assert 2.9e9 < qwen.active < 3.4e9  # "3.3B activated" (the embedding table is not a matmul)


def test_trainer_flops_and_time_by_hand():
    run = load_config("scalerl", "llama3_8b")
    m, r = run.model, run.rollout
    cost = step_cost(run, response_tokens=10000)
    p = parameters(m)
    sequence = r.max_prompt_tokens / 2 + 10000
    tokens = r.prompts_per_step * r.generations_per_prompt * sequence
    d_attn = m.num_attention_heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    per_token = 6 * (p.total - m.vocab_size * m.hidden_size) + 6 * m.num_layers * d_attn * sequence / 2
    if run.trainer.recompute.granularity == "full":
        per_token *= 8 / 6
    assert cost.train_flops == pytest.approx(tokens * per_token, rel=1e-9)
    peak = run.parallel.trainer_devices * 989.4e12  # H100 SXM, dense bf16
    assert cost.train_s == pytest.approx(tokens * per_token / (peak * Efficiency().mfu))


def test_decode_is_memory_bound_at_small_batches_by_hand():
    run = load_config("scalerl", "llama3_8b", ["rollout.interruption.enabled=false", "rollout.answer_tokens=2000"])
    cost = step_cost(run, response_tokens=1000)
    p, r = parameters(run.model), run.rollout
    batch = math.ceil(r.groups_in_flight * r.generations_per_prompt / r.engine.num_engines)
    kv = 2 * run.model.num_layers * run.model.num_query_groups * 128 * 2  # K and V, bf16, head dim 128
    context = r.max_prompt_tokens / 2 + 500
    iteration = (2 * p.total + batch * context * kv) / r.engine.tp / (GPUS["h100"][1] * Efficiency().decode_bandwidth)
    assert cost.decode_batch == batch
    assert cost.decode_tokens_per_s == pytest.approx(batch / iteration * r.engine.num_engines)


def test_the_two_modes_overlap_as_the_pipeline_runs():
    pipeline = step_cost(load_config("scalerl", "llama3_8b"))
    assert pipeline.step_s == pytest.approx(max(pipeline.generate_s, pipeline.train_s + pipeline.push_s))
    off = step_cost(load_config("scalerl", "llama3_8b", ["rollout.mode=ppo_off_policy", "rollout.k=8"]))
    rounds = off.round_s  # eight batches started together, the longest completions setting the round's length
    expected = (max(rounds + off.train_s, rounds / 8 + 8 * off.train_s) + off.push_s) / 8
    assert off.step_s == pytest.approx(expected)
    assert off.gpu_hours_per_step == pytest.approx(off.step_s * 80 / 3600)
    slow_sync = step_cost(load_config("scalerl", "llama3_8b"), efficiency=Efficiency(sync_gbps=0.5))
    assert slow_sync.push_s > pipeline.push_s and slow_sync.step_s >= pipeline.step_s
    with pytest.raises(ValueError, match="no figures for GPU 'v100'"):
        step_cost(load_config("scalerl", "llama3_8b"), gpu="v100")


def test_a_synchronous_round_lasts_as_long_as_its_longest_completions_by_simulation():
    from megatron_rl.scaling.cost import _Decode

    run = load_config("scalerl", "llama3_8b")
    peak, bandwidth = GPUS["h100"]
    decode = _Decode(run.model, parameters(run.model), 1, peak, bandwidth, Efficiency())
    rng = np.random.default_rng(0)
    batch, prompt, mean, budget = 128, 200.0, 800.0, 4096
    simulated = []
    for _ in range(20):  # decode every iteration while any sequence runs, the batch thinning as they finish
        lengths = np.minimum(rng.exponential(mean, batch), budget).astype(int)
        steps = np.arange(lengths.max())
        running = (lengths[None, :] > steps[:, None]).sum(1)
        simulated.append(
            sum(decode.iteration_s(b, prompt + t) for t, b in zip(steps[::8], running[::8], strict=True)) * 8
        )
    assert decode.round_s(batch, prompt, mean, budget) == pytest.approx(np.mean(simulated), rel=0.05)
    # far longer than the steady throughput would say: the tail decodes at a small batch
    steady = batch * mean * decode.iteration_s(batch, prompt + mean / 2) / batch
    assert decode.round_s(batch, prompt, mean, budget) > 2 * steady


def test_plan_sweeps_a_key_at_equal_compute(capsys):
    argv = ["plan", "--recipe", "scalerl", "--model", "llama3_8b", "--sweep", "rollout.prompts_per_step=24,48"]
    assert main([*argv, "--budget", "5000"]) == 0
    out = capsys.readouterr().out
    for value in (24, 48):
        cost = step_cost(load_config("scalerl", "llama3_8b", [f"rollout.prompts_per_step={value}"]))
        steps = math.floor(5000 / cost.gpu_hours_per_step)
        assert f"rollout.prompts_per_step={value}: {cost.gpu_hours_per_step:,.3f} GPU-hours/step" in out
        assert f"rollout.prompts_per_step={value} total_steps={steps} name=scalerl-{value}" in out
    assert main(argv) == 2
    assert "--sweep needs --budget" in capsys.readouterr().err


def test_plan_calibrates_against_a_run(tmp_path, capsys):
    run = load_config("scalerl", "llama3_8b")
    save_config(run, tmp_path / "config.yaml")
    predicted = step_cost(run, response_tokens=6000).gpu_hours_per_step
    rows = [{"run": {"name": "x"}}]
    for step in range(1, 11):  # measured: 1.25 x the model's estimate per step
        rows.append({"step": step, "device_hours": 1.25 * predicted * step, "train/loss": 0.0,
                     "train/response_length": 6000.0, "time/step_s": 100.0})  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = calibrate(run, tmp_path / "metrics.jsonl")
    assert result.steps == 9 and result.error == pytest.approx(1 / 1.25 - 1)
    assert main(["plan", "--calibrate", str(tmp_path)]) == 0
    assert "error      -20%: scale the plan's GPU-hours for this layout by 1.25" in capsys.readouterr().out
    cpu = load_config("scalerl-cpu")
    save_config(cpu, tmp_path / "config.yaml")
    assert main(["plan", "--calibrate", str(tmp_path)]) == 2
    assert "figures for GPUs only" in capsys.readouterr().err
