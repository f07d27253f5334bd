"""`megatron-rl check` reads the starting checkpoint (`model.hf_path`) before anything starts: config.json's
architecture and dimensions against the model config, every weight file present and complete, every tensor's name
and shape, from the safetensors headers alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_rl.cli import main
from megatron_rl.config import load_config
from megatron_rl.models import canonical_shapes, family, hf_shapes


def _checkpoint(out: Path, model: str, weights: bool = True, shards: int = 1) -> Path:
    """An HF directory of `model`'s architecture: its config.json and zero weights of the right shapes."""
    cfg = load_config("scalerl-cpu", model).model
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(family(cfg).hf_config(cfg)))
    if weights:
        tensors = {name: torch.zeros(shape) for name, shape in hf_shapes(cfg, canonical_shapes(cfg).items()).items()}
        names = sorted(tensors)
        if shards == 1:
            save_file(tensors, out / "model.safetensors")
        else:
            weight_map = {}
            for i in range(shards):
                file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
                part = {name: tensors[name] for name in names[i::shards]}
                save_file(part, out / file)
                weight_map.update(dict.fromkeys(part, file))
            (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def _check(hf: Path, model: str = "cpu_demo", recipe: str = "scalerl-cpu") -> int:
    return main(["check", "--recipe", recipe, "--model", model, f"model.hf_path={hf}"])


def _refused(capsys, hf: Path, pattern: str, model: str = "cpu_demo", recipe: str = "scalerl-cpu") -> None:
    """`check` exits 2 with one line naming what differs."""
    assert _check(hf, model, recipe) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(pattern, err), err


def test_a_matching_checkpoint_passes(tmp_path, capsys):
    assert _check(_checkpoint(tmp_path / "ok", "cpu_demo", shards=3)) == 0
    assert "matching cpu_demo" in capsys.readouterr().out


def test_another_models_checkpoint_is_refused(tmp_path, capsys):
    llama = _checkpoint(tmp_path / "llama", "tiny_dense", weights=False)  # the Llama family, other dimensions
    _refused(capsys, llama, r"model.hf_path: .*config.json disagrees .*model.hidden_size")
    _refused(capsys, llama, "is a llama model, model.family is 'llama4'", "llama4_scout_17bx16e", "scalerl")


def test_a_directory_without_weights_is_refused(tmp_path, capsys):
    _refused(capsys, _checkpoint(tmp_path / "none", "cpu_demo", weights=False), "no weights")


def test_a_weight_file_cut_short_or_missing_is_named(tmp_path, capsys):
    cut = _checkpoint(tmp_path / "cut", "cpu_demo", shards=2)
    shard = cut / "model-00002-of-00002.safetensors"
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 4)
    _refused(capsys, cut, "model-00002-of-00002.safetensors: .* cut short")
    shard.unlink()
    _refused(capsys, cut, "model-00002-of-00002.safetensors: weight file missing")


def test_a_missing_or_misshapen_tensor_is_named(tmp_path, capsys):
    hf = _checkpoint(tmp_path / "bad", "cpu_demo")
    from safetensors.torch import load_file

    tensors = load_file(hf / "model.safetensors")
    del tensors["model.norm.weight"]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1]
    save_file(tensors, hf / "model.safetensors")
    _refused(capsys, hf, r"missing tensors: model.norm.weight.*shape mismatches: lm_head.weight")
