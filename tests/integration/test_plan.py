"""`megatron-rl plan` on the shipped model configs at full size: real megatron models on the meta device under
a fake process group of the full world size, against the device, the Slurm allocation and published layouts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def _plan(*args: str) -> subprocess.CompletedProcess:
    return _plans(args)[0]


def _plans(*calls: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """`megatron-rl plan` once per call, all started together: each spends seconds importing megatron-core and
    building on the meta device, so a test's independent calls share the machine's cores instead of queueing."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    commands = [[sys.executable, "-m", "megatron_rl.cli", "plan", *args] for args in calls]
    processes = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for c in commands
    ]
    results = []
    try:
        for command, process in zip(commands, processes, strict=True):
            stdout, stderr = process.communicate(timeout=600)
            results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    finally:
        for process in processes:
            process.kill()  # only those past the timeout are still running
            process.wait()
    return results


def _total(out: str) -> float:
    return float(re.search(r"trainer PP0 .* (\d+\.\d)\n", out).group(1))


@pytest.mark.parametrize("script", ["scalerl_moe.sh", "scalerl_dense.sh"])
def test_slurm_scripts_fit_their_allocation(script):
    text = (ROOT / "slurm" / script).read_text()
    nodes = re.search(r"#SBATCH --nodes=(\d+)", text).group(1)
    model = re.search(r"MODEL=\$\{MODEL:-(\w+)\}", text).group(1)
    result = _plan("--model", model, "--allocation", f"{nodes}x8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "plan: fits" in result.stdout and "allocation:" in result.stdout


def test_the_plan_prints_its_table_without_library_noise_and_says_plainly_when_a_run_is_on_cpu():
    """Python's default warning filters (not the PYTHONWARNINGS=ignore of the other tests): megatron-core's
    import-time warnings about TE, Apex and absl stay out of the output; a CPU recipe is not an error."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    command = [sys.executable, "-m", "megatron_rl.cli", "plan"]
    gpu = subprocess.run([*command, "--model", "llama3_8b"], capture_output=True, text=True, env=env, timeout=600)
    assert gpu.returncode == 0, gpu.stdout + gpu.stderr
    assert gpu.stdout.startswith("memory plan: llama3_8b") and "Warning" not in gpu.stdout + gpu.stderr
    cpu = subprocess.run([*command, "--recipe", "scalerl-cpu"], capture_output=True, text=True, env=env, timeout=600)
    assert cpu.returncode == 0 and cpu.stderr == ""
    assert cpu.stdout.startswith("memory plan: scalerl-cpu runs on CPU cores") and "error" not in cpu.stdout


@pytest.mark.parametrize("model", ["qwen3_8b", "qwen3_30b_a3b", "qwen3_4b"])
def test_every_shipped_layout_fits_its_device(model):
    result = _plan("--model", model)
    assert result.returncode == 0, result.stdout + result.stderr
    assert _total(result.stdout) < 79.6


def test_scout_on_the_papers_16_trainer_gpus_is_refused_with_the_numbers_and_what_fits():
    """18 B per parameter before activations: Scout's weights, fp32 gradients and Adam states need more than
    16 H100s hold. The refusal says how much and which one-step changes fit."""
    result = _plan("--model", "llama4_scout_17bx16e", "parallel.trainer_devices=16", "parallel.ep=8")
    assert result.returncode == 2
    assert re.search(r"does not fit: trainer stage 0: 1\d\d\.\d GiB per GPU > 79\.6 GiB", result.stdout)
    assert "fits with: 64 trainer GPUs" in result.stdout
    assert "memory plan" in result.stderr  # the CLI's one-line refusal


def test_published_layouts_fit_and_an_undersized_one_is_refused():
    # NeMo-RL's Qwen3-30B-A3B CISPO recipe (2 nodes x 8 H100: TP 2 + SP, EP 8, 4,096-token packed rows).
    nemo_rl = ["parallel.trainer_devices=16", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=8"]
    nemo_rl += ["trainer.micro_batch_tokens=4096", "rollout.max_prompt_tokens=1024", "rollout.answer_tokens=1024"]
    nemo_rl += ["rollout.interruption.min_thinking_tokens=2048", "rollout.interruption.max_thinking_tokens=2048"]
    nemo_rl += ["trainer.recompute.granularity=none"]
    # NeMo-RL's examples/configs/grpo_math_8B_megatron.yaml: Llama-3.1-8B on 1 node x 8 H100, TP 1, PP 2, no
    # SP, no activation checkpointing, 4,096-token packed rows.
    nemo_rl_8b = ["parallel.trainer_devices=8", "parallel.tp=1", "parallel.pp=2", "parallel.sequence_parallel=false"]
    nemo_rl_8b += ["trainer.micro_batch_tokens=4096", "rollout.max_prompt_tokens=1024", "rollout.answer_tokens=1024"]
    nemo_rl_8b += ["rollout.interruption.min_thinking_tokens=2048", "rollout.interruption.max_thinking_tokens=2048"]
    # Megatron-Bridge's recipes/llama/llama4_e16.py (Scout): TP 4 + SP, PP 1, ETP 4, EP 16, 8,192-token
    # sequences, no recompute; 64 GPUs is the smallest world its ETP x EP forms.
    bridge = ["parallel.trainer_devices=64", "parallel.tp=4", "parallel.sequence_parallel=true", "parallel.ep=16"]
    bridge += ["parallel.etp=4", "trainer.micro_batch_tokens=8192", "rollout.max_prompt_tokens=2048"]
    bridge += ["rollout.answer_tokens=2048", "rollout.interruption.min_thinking_tokens=4096"]
    bridge += ["rollout.interruption.max_thinking_tokens=4096", "trainer.recompute.granularity=none"]
    # Deliberately undersized: Qwen3-30B-A3B on 4 H100s (EP 4) holds 7.6B expert parameters per GPU at 18 B each.
    nemo_fits, nemo_8b_fits, bridge_fits, refused = _plans(
        ("--model", "qwen3_30b_a3b", *nemo_rl),
        ("--model", "llama3_8b", *nemo_rl_8b, "trainer.recompute.granularity=none"),
        ("--model", "llama4_scout_17bx16e", *bridge),
        ("--model", "qwen3_30b_a3b", "parallel.trainer_devices=4", "parallel.ep=4"),
    )
    assert nemo_fits.returncode == 0, nemo_fits.stdout + nemo_fits.stderr
    for fits in (nemo_8b_fits, bridge_fits):
        assert fits.returncode == 0 and "plan: fits" in fits.stdout, fits.stdout + fits.stderr
    assert refused.returncode == 2 and "does not fit" in refused.stdout
    assert "fits with:" in refused.stdout


def test_a_bad_allocation_or_a_device_nothing_fits_is_refused_before_anything_starts():
    short = _plan("--model", "llama3_8b", "--allocation", "9x8")
    assert short.returncode == 2
    assert "needs 16 trainer + 64 generator GPUs = 80, allocation has 9 x 8 = 72" in short.stderr
    tiny = _plan("--model", "llama3_8b", "compute.device_memory_gib=8")
    assert tiny.returncode == 2 and "> 8.0 GiB" in tiny.stdout


def test_a_setting_megatron_refuses_while_building_is_a_config_error_naming_the_field():
    # megatron-core's TransformerConfig: the allgather dispatcher refuses variable sequence lengths (packed rows).
    result = _plan("--model", "qwen3_30b_a3b", "model.moe.token_dispatcher=allgather")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "config error: model.moe.token_dispatcher: megatron-core refuses this configuration" in result.stderr
    assert "allgather does not support variable sequence length" in result.stderr
    assert "Traceback" not in result.stderr
    # The same rule for moe_act recompute is megatron-core's, applied at config time (tests/unit/test_config.py).
    moe_act = _plan("--model", "qwen3_30b_a3b", "trainer.layer_spec=local", "trainer.recompute.granularity=selective",
                    "trainer.recompute.modules=[moe_act]")  # fmt: skip
    assert moe_act.returncode == 2 and "config error: trainer.recompute.modules:" in moe_act.stderr
    assert "Traceback" not in moe_act.stderr


def test_llama3_8b_shard_matches_megatron_lm_theoretical_weights_and_optimizer():
    """Megatron-LM's theoretical memory accounting: the most loaded TP shard holds (layers + 2 V h) / tp
    parameters (GQA and SwiGLU in its layer formula) and needs 6 + 12 / dp bytes each with the distributed
    optimizer; ours is exact from the model plus 2 B more per fp32 LM-head parameter."""
    result = _plan("--model", "llama3_8b")
    assert result.returncode == 0, result.stdout + result.stderr
    row = re.search(r"trainer PP0 +([\d.]+)B +([\d.]+) +([\d.]+) +([\d.]+)", result.stdout)
    params, weights, grads, optim = (float(x) for x in row.groups())
    layers, h, ffn, vocab, heads, groups, tp, dp = 32, 4096, 14336, 128256, 32, 8, 2, 8
    per_layer = 2 * h * h * ((1 + groups / heads) + ffn / h * 3 / 2 + 2 / h + 1 / (layers * h))
    shard = (layers * per_layer + 2 * vocab * h) / tp
    assert params * 1e9 == pytest.approx(shard, rel=5e-3)
    head_extra = 2.0 * vocab * h / tp  # the fp32 LM head: 4 B instead of 2
    expected = (shard * (6 + 12 / dp) + head_extra) / 2**30
    assert weights + grads + optim == pytest.approx(expected, rel=2e-2)


def test_the_plan_builds_on_the_meta_device_on_a_host_with_cuda(monkeypatch):
    """The Slurm bootstrap plans on a GPU node. There too the model is built on the meta device under the fake
    process group, nothing is moved to or allocated on a GPU, and the counts are the ones of a CPU host."""
    import torch

    from megatron_rl.config import load_config
    from megatron_rl.plan import make_plan

    run = load_config("scalerl", "qwen3_30b_a3b", [])
    on_cpu = make_plan(run, suggest=False)

    def touched_cuda(*args, **kwargs):
        raise AssertionError("the memory plan touched CUDA")

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.nn.Module, "cuda", touched_cuda)
        m.setattr(torch.cuda, "_lazy_init", touched_cuda)  # every CUDA allocation, stream or context
        m.setattr(torch.cuda, "current_device", touched_cuda)
        with_cuda = make_plan(run, suggest=False)
    assert [(r.dense_params, r.expert_params) for r in with_cuda.ranks] == [
        (r.dense_params, r.expert_params) for r in on_cpu.ranks
    ]
    assert with_cuda.fits and with_cuda.ranks[0].total == on_cpu.ranks[0].total


def test_a_kv_pool_short_of_the_sequences_in_flight_warns_but_fits():
    result = _plan("--model", "llama3_8b", "rollout.engine.mem_fraction=0.4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8 of the 24 sequences in flight per engine fit at 16384 tokens each" in result.stdout
    assert "warning: engine: the KV pool holds 8 of the 24 sequences in flight per engine" in result.stdout
    assert "plan: fits" in result.stdout


OFFLOAD_HALF = ["trainer.optimizer.cpu_offload=true", "trainer.optimizer.offload_fraction=0.5"]
LONG_CONTEXT = {  # docs/guide.md §1, "Long contexts": every row fits with a tenth of the device free
    "llama3_8b_32k": ("--recipe", "scalerl-32k", "--model", "llama3_8b"),
    "scout_32k": ("--recipe", "scalerl-32k", "--model", "llama4_scout_17bx16e", *OFFLOAD_HALF),
    "scout_64k": ("--recipe", "scalerl-64k", "--model", "llama4_scout_17bx16e", *OFFLOAD_HALF),
    "scout_16_gpus": ("--model", "llama4_scout_17bx16e", "parallel.trainer_devices=16",
                      "trainer.optimizer.cpu_offload=true"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LONG_CONTEXT))
def test_long_context_and_offload_layouts_fit_with_a_tenth_of_the_device_free(name):
    result = _plan(*LONG_CONTEXT[name])
    assert result.returncode == 0, result.stdout + result.stderr
    assert _total(result.stdout) <= 0.9 * 79.6
    assert "GPU build: Transformer Engine" in result.stdout  # megatron's TE spec built with the layout's CP
    if name == "llama3_8b_32k":  # 32 layers of 16,448 tokens per rank (TP 2 + SP, CP 2) + one MLP backward
        s, t = 32896 / 2, 2
        layer = s / t * (2 * 4096 * 2 + 2 * (4096 + 2048) + 2 * 4096 + 4 * 32 + 2 * 4096 * 2 + 2 * 3 * 14336)
        activations = (32 * layer + 2 * s * 3 * 14336 / t) / 2**30
        row = re.search(r"trainer PP0 +\S+ +\S+ +\S+ +\S+ +(\d+\.\d)", result.stdout)
        assert float(row.group(1)) == pytest.approx(activations, abs=0.05)
    if "offload" in " ".join(LONG_CONTEXT[name]):
        assert re.search(r"optimizer offload: .* GiB per rank .* node need \d+ GiB", result.stdout)


def test_a_long_row_without_context_parallel_is_refused_with_cp_and_offload_among_the_fixes():
    # the third: nodes of 4 GPUs (an allocation of 20 x 4, engines of TP 4): half the ranks, half the host memory
    result, host, four = _plans(
        ("--recipe", "scalerl-32k", "--model", "llama4_scout_17bx16e", "parallel.cp=1"),
        ("--model", "llama4_scout_17bx16e", "parallel.trainer_devices=16", "trainer.optimizer.cpu_offload=true",
         "compute.host_memory_gib=512"),
        ("--model", "llama4_scout_17bx16e", "parallel.trainer_devices=16", "trainer.optimizer.cpu_offload=true",
         "rollout.engine.tp=4", "rollout.engine.num_engines=16", "--allocation", "20x4"),
    )  # fmt: skip
    assert result.returncode == 2
    assert "fits with: CP 2 (parallel.cp=2)" in result.stdout
    assert "fits with: optimizer offload (trainer.optimizer.cpu_offload=true)" in result.stdout
    assert host.returncode == 2 and "trainer host memory: 803 GiB per node of 8 trainer GPUs" in host.stdout
    assert four.returncode == 0 and "the trainer ranks of a node need 402 GiB" in four.stdout, four.stdout
