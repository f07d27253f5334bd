"""Optimizer CPU offload (`trainer.optimizer.cpu_offload`) through megatron-core's HybridDeviceOptimizer.

Three steps with the Adam state (all of it, or half by parameters) kept and updated on the host give the same
parameters as three steps without offload, at DP 2 with the distributed optimizer: fp32 (the same arithmetic,
up to the fused host kernel's rounding) and a bf16 body with the FP32 LM head (fp32 master copies on the host,
rounded to bf16 on the way back, as without offload). The same holds from a trained Hugging Face start, where the
hybrid optimizer's copies, made when it is built, must follow the loaded weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import _run  # noqa: E402

from megatron_rl.config import ConfigError, load_config  # noqa: E402

STEPS = ["trainer.optimizer.lr=1e-3", "trainer.optimizer.warmup_steps=0", "parallel.trainer_devices=2"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype, fraction", [("fp32", 1.0), ("fp32", 0.5), ("bf16", 0.5)])
def test_steps_with_and_without_offload_give_the_same_parameters(tmp_path, dtype, fraction):
    """fp32: every parameter within 1e-3 of how far its tensor moved (three Adam steps at lr 1e-3 move each by
    ~3e-3; a wrong or skipped offloaded update would be off by as much). The host's and the device's Adam round
    differently: on an AMD EPYC host a few elements per tensor differ by 1.2e-4 of the move (3.6e-7). bf16: the same
    bf16 values up to one ulp, or within 1e-2 of the move for values near zero, whose ulp is finer than the fp32
    master weights' rounding carried through three bf16 forward/backward passes (measured up to 2.9e-3 of the move
    there)."""
    common = STEPS + [f"trainer.params_dtype={dtype}"]
    offload = ["trainer.optimizer.cpu_offload=true", f"trainer.optimizer.offload_fraction={fraction}"]
    runs = {}
    for name, overrides in (("device", common), ("offload", common + offload)):
        spec = {"overrides": overrides, "steps": 3, "dump_final": str(tmp_path / f"{name}_params")}
        if name == "device":
            spec["dump_state"] = str(tmp_path / "initial.pt")  # the parameters before the steps
        runs[name] = _run(tmp_path, name, spec, world=2)
    assert {r["optimizer"] for r in runs["offload"]} == {"HybridDeviceOptimizer"}
    assert {r["optimizer"] for r in runs["device"]} != {"HybridDeviceOptimizer"}
    start = torch.load(tmp_path / "initial.pt", weights_only=False)["state"]
    trained = 0
    for rank in range(2):
        device = torch.load(tmp_path / f"device_params.rank{rank}", weights_only=False)
        offloaded = torch.load(tmp_path / f"offload_params.rank{rank}", weights_only=False)
        names = [name for name in device if "_extra_state" not in name]
        assert sorted(device) == sorted(offloaded) and len(names) > 10
        for name in names:
            value, other = device[name].float(), offloaded[name].float()
            moved = float((value - start[name].float()).abs().max())
            trained += moved > 0
            if dtype == "fp32":
                torch.testing.assert_close(other, value, rtol=0, atol=1e-3 * moved, msg=name)
            else:
                torch.testing.assert_close(other, value, rtol=2**-7, atol=max(1e-6, 1e-2 * moved), msg=name)
    assert trained >= len(names)  # bf16 norm weights at 1.0 may round back: most parameters moved on both ranks
    for a, b in zip(runs["offload"][0]["steps"], runs["device"][0]["steps"], strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("dtype, fraction", [("fp32", 1.0), ("bf16", 0.5)])
def test_offload_from_a_trained_start_keeps_the_loaded_weights(tmp_path, trained_policy, dtype, fraction):
    """From the trained CPU policy (a Hugging Face checkpoint loaded after the optimizer is built), three steps with
    offload land where three steps without it do, close to the trained weights. Before the hybrid optimizer's
    copies followed the load, the first offloaded step wrote the build's random weights back: every parameter
    moved by about its whole value (entropy ln 512 at step 2 of a run)."""
    common = STEPS + [f"trainer.params_dtype={dtype}", "trainer.optimizer.lr=1e-4"]
    offload = ["trainer.optimizer.cpu_offload=true", f"trainer.optimizer.offload_fraction={fraction}"]
    runs = {}
    for name, overrides in (("device", common), ("offload", common + offload)):
        spec = {"overrides": overrides, "steps": 3, "hf": str(trained_policy), "on_policy": True}
        spec["dump_final"] = str(tmp_path / f"{name}_params")
        if name == "device":
            spec["dump_state"] = str(tmp_path / "loaded.pt")
        runs[name] = _run(tmp_path, name, spec, world=2)
    assert {r["optimizer"] for r in runs["offload"]} == {"HybridDeviceOptimizer"}
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)["state"]
    device = torch.load(tmp_path / "device_params.rank0", weights_only=False)
    offloaded = torch.load(tmp_path / "offload_params.rank0", weights_only=False)
    names = [name for name in device if "_extra_state" not in name]
    for name in names:
        start, value, other = loaded[name].float(), device[name].float(), offloaded[name].float()
        scale = float(start.abs().max())
        # three Adam steps at lr 1e-4 move an element by at most ~3e-4 (more only through bf16 rounding)
        assert float((value - start).abs().max()) < 1e-3 + 2**-7 * scale, name
        assert float((other - value).abs().max()) < 1e-4 + 2**-7 * scale, name
    # the policy is the trained one on both sides: the same log-probs of the batch before and after the steps
    for a, b in zip(runs["offload"][0]["steps"], runs["device"][0]["steps"], strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-3, abs=1e-4)


@pytest.mark.slow
def test_offload_resumes_from_its_checkpoints(tmp_path, trained_policy):
    """Offloaded runs from the trained start: two steps, a checkpoint, then a full resume takes the third step as an
    uninterrupted run does, and a model-only load (fresh optimizer state) continues from the saved weights."""
    offload = STEPS + ["trainer.optimizer.lr=1e-4", "trainer.optimizer.cpu_offload=true"]
    offload += ["trainer.optimizer.offload_fraction=0.5"]
    base = {"overrides": offload, "on_policy": True}
    checkpoint = str(tmp_path / "ckpt")

    def final(name: str, **spec) -> dict:
        _run(tmp_path, name, {**base, **spec, "dump_final": str(tmp_path / f"{name}_params")}, world=2)
        return torch.load(tmp_path / f"{name}_params.rank0", weights_only=False)

    whole = final("whole", hf=str(trained_policy), steps=3)
    saved = final("saved", hf=str(trained_policy), steps=2, save=checkpoint)
    resumed = final("resumed", load=checkpoint + "/step_00000002", steps=1)
    fresh = final("fresh", load=checkpoint + "/step_00000002", model_only=True, steps=0)
    for name in (n for n in whole if "_extra_state" not in n):
        torch.testing.assert_close(resumed[name], whole[name], rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(fresh[name], saved[name], rtol=0, atol=0, msg=name)


def test_offload_needs_the_distributed_optimizer():
    with pytest.raises(ConfigError, match="trainer.optimizer.cpu_offload"):
        load_config(
            "scalerl-cpu", "cpu_demo", ["trainer.optimizer.cpu_offload=true", "parallel.distributed_optimizer=false"]
        )
    with pytest.raises(ConfigError, match=r"offload_fraction.*\(0, 1\]"):
        load_config("scalerl-cpu", "cpu_demo", ["trainer.optimizer.offload_fraction=0"])
