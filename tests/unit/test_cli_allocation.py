"""`check --allocation` / `plan --allocation`: the recipe's GPU split against NODESxGPUS_PER_NODE, before anything
starts (slurm/bootstrap.sh runs it with the Slurm allocation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import check_allocation
from megatron_rl.config import ConfigError, load_config

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(
    ("allocation", "message"),
    [
        ("10x0", "--allocation 10x0: 0 GPUs per node; this GPU run needs at least 1"),
        ("0x8", "--allocation 0x8: 0 nodes; an allocation has at least 1 node"),
        ("-1x8", "--allocation -1x8: -1 nodes"),
        ("9x8", "needs 16 trainer + 64 generator GPUs = 80, allocation has 9 x 8 = 72"),
        ("16x5", "parallel.tp=2 must divide the 5 GPUs of a node (a TP group in one node)"),
        ("ten", "--allocation: expected NODESxGPUS_PER_NODE"),
    ],
)
def test_an_allocation_the_run_cannot_use_is_refused_naming_the_number(allocation, message):
    with pytest.raises(ConfigError) as info:
        check_allocation(load_config("scalerl", "llama3_8b"), allocation)
    assert message in str(info.value)


def test_an_engine_tp_that_does_not_divide_a_node_is_refused():
    with pytest.raises(ConfigError, match=r"rollout.engine.tp=8 must divide the 4 GPUs of a node"):
        check_allocation(load_config("scalerl", "llama4_scout_17bx16e"), "32x4")


def test_an_allocation_larger_than_the_run_is_refused_with_the_numbers():
    with pytest.raises(ConfigError) as info:
        check_allocation(load_config("scalerl", "llama3_8b"), "11x8")
    assert (
        "11 x 8 = 88 GPUs is larger than the run needs: 16 trainer + 64 generator GPUs fit 10 node(s) of 8, "
        "so 1 node(s) (8 GPUs) would sit idle"
    ) in str(info.value)


def test_the_slurm_scripts_allocations_and_a_cpu_run_without_gpus_pass(capsys):
    check_allocation(load_config("scalerl", "llama3_8b"), "10x8")
    check_allocation(load_config("scalerl", "llama3_8b"), "20x4")  # same GPUs on smaller nodes
    check_allocation(load_config("scalerl", "llama4_scout_17bx16e"), "16x8")
    check_allocation(load_config("scalerl-cpu", "cpu_demo"), "1x0")  # test_slurm.py's CPU job: no GPUs at all
    out = capsys.readouterr().out
    assert "80: 16 train" in out and "128: 64 train" in out and "CPU run" in out


def test_engines_may_share_the_trainers_last_node():
    # 4 trainer GPUs + 2 engines of TP 2 fill one node of 8, as the Ray placement packs them.
    run = load_config("scalerl", "qwen3_4b", ["parallel.trainer_devices=4", "rollout.engine.tp=2",
                                              "rollout.engine.num_engines=2"])  # fmt: skip
    check_allocation(run, "1x8")
    with pytest.raises(ConfigError, match=r"fit 1 node\(s\) of 8, so 1 node\(s\) \(8 GPUs\) would sit idle"):
        check_allocation(run, "2x8")


def test_the_slurm_bootstrap_passes_model_path_as_the_checkpoint():
    text = (ROOT / "slurm" / "bootstrap.sh").read_text()
    assert 'overrides+=("model.hf_path=$MODEL_PATH")' in text
    for script in ("scalerl_moe.sh", "scalerl_dense.sh"):
        assert "MODEL_PATH=/ckpt/" in (ROOT / "slurm" / script).read_text()


def test_a_cpu_run_gets_a_ray_slot_for_each_actor_or_is_refused():
    from megatron_rl.orchestration.placement import check_cpu_slots, cpu_processes, local_ray_cpus

    moe = load_config("scalerl-cpu", "tiny_moe")  # EP 2: two trainer ranks and one engine
    assert cpu_processes(moe) == 3
    # a local Ray: the engine is the driver's own process, so one slot per trainer rank, never an idle one more
    assert cpu_processes(moe, local_engines=True) == 2
    assert local_ray_cpus(moe, cores=2) == 2 and local_ray_cpus(moe, cores=16) == 2
    assert local_ray_cpus(load_config("scalerl-cpu"), cores=2) == 1
    check_cpu_slots(moe, 3.0)
    check_cpu_slots(moe, 2.0, local_engines=True)
    with pytest.raises(ConfigError, match=r"starts 3 processes \(2 trainer ranks \+ 1 engine\(s\)\).*has 2"):
        check_cpu_slots(moe, 2.0)  # an external Ray cluster that is too small: refused, not a silent wait
    with pytest.raises(ConfigError, match=r"starts 2 processes \(2 trainer ranks \+ 0 engine\(s\)\).*has 1"):
        check_cpu_slots(moe, 1.0, local_engines=True)
    assert cpu_processes(load_config("scalerl", "qwen3_4b")) == 0  # GPU runs take GPU bundles
    assert local_ray_cpus(load_config("scalerl", "qwen3_4b"), cores=16) == 16
