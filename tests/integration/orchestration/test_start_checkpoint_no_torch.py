"""The training driver checks its starting checkpoint (`model.hf_path`) before anything starts, without importing
torch (~140 MiB it would hold for the whole run): config.json against the model config and every weight file
complete. The tensors' names and shapes are checked by each trainer rank as it imports them, and by
`megatron-rl check` (tests/unit/test_check_checkpoint.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

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
