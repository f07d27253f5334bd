"""The training driver checks its starting checkpoint (`model.hf_path`) before anything starts, without importing
torch (~140 MiB it would hold for the whole run): config.json against the model config and every weight file
complete. The tensors' names and shapes are checked by each trainer rank as it imports them, by
`megatron-rl check` (tests/unit/test_check_checkpoint.py), and by the driver when an engine fails to start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config import load_config
from megatron_rl.models import canonical_shapes, family, hf_shapes

PROBE = """
import json, sys
from megatron_rl.config import ConfigError, load_config
from megatron_rl.orchestration.warmstart import prepare_policy
out = {}
for name, path in json.loads(sys.argv[1]).items():
    run = load_config("scalerl-cpu", None, [f"model.hf_path={path}"])
    try:
        out[name] = str(prepare_policy(run, None))
    except ConfigError as exc:
        out[name] = f"ConfigError: {exc}"
out["torch"] = "torch" in sys.modules
print(json.dumps(out))
"""


def _checkpoint(out: Path, model: str) -> Path:
    cfg = load_config("scalerl-cpu", model).model
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(family(cfg).hf_config(cfg)))
    tensors = {name: torch.zeros(shape) for name, shape in hf_shapes(cfg, canonical_shapes(cfg).items()).items()}
    save_file(tensors, out / "model.safetensors")
    return out


def test_the_driver_checks_the_starting_checkpoint_without_torch(tmp_path: Path) -> None:
    good = _checkpoint(tmp_path / "good", "cpu_demo")
    other = _checkpoint(tmp_path / "other", "tiny_dense")  # the same family, other dimensions
    cut = _checkpoint(tmp_path / "cut", "cpu_demo")
    with (cut / "model.safetensors").open("r+b") as f:
        f.truncate((cut / "model.safetensors").stat().st_size - 4)
    paths = {"good": str(good), "other": str(other), "cut": str(cut)}
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(paths)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got["good"] == str(good)
    assert got["other"].startswith("ConfigError: model.hf_path: ") and "config.json disagrees" in got["other"], got
    assert got["cut"].startswith("ConfigError: model.hf_path: ") and "cut short" in got["cut"], got
    assert got["torch"] is False, "checking model.hf_path imported torch in the driver"


def test_a_start_from_a_model_with_one_misshapen_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    """config.json matches and the files are whole, so the driver's torch-free check lets the start go on; the
    engine then dies loading the misshapen tensor, on a bare assertion in SGLang's loader. `megatron-rl train` is
    refused as a config error whose message names the tensor and both shapes, and leaves no process behind."""
    from megatron_rl.orchestration.warmstart import base_model

    run = load_config("scalerl-cpu")
    bad = tmp_path / "policy"
    shutil.copytree(base_model(run, tmp_path / "cache"), bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    expected = tuple(tensors[name].shape)
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    cli = Path(sys.executable).with_name("megatron-rl")
    overrides = [f"output_dir={tmp_path / 'runs'}", "name=bad", f"model.hf_path={bad}", "total_steps=1"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    result = subprocess.run([str(cli), "train", "--recipe", "scalerl-cpu", *overrides], capture_output=True, text=True,
                            env=env, timeout=600)  # fmt: skip
    got, tail = (expected[0], expected[1] - 1), result.stderr[-3000:]
    assert result.returncode == 2, tail
    assert f"config error: starting model: {bad}: does not match the llama model" in result.stderr, tail
    assert f"shape mismatches: {name} (expected {expected}, got {got})" in result.stderr, tail
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(bad) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, [" ".join(p.info["cmdline"])[:200] for p in leftovers]
