"""A failed engine start in `megatron-rl train` (orchestration/train.py `_engines_started`): explained by the starting
model's full check when a tensor does not match the model, its own error otherwise."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.config import ConfigError, load_config
from megatron_rl.generator.client import EngineUnavailableError
from megatron_rl.models import canonical_shapes, family, hf_shapes
from megatron_rl.orchestration.train import _engines_started


class FailingEngines:
    async def start(self) -> None:
        raise EngineUnavailableError("http://127.0.0.1:1", "SGLang server exited with code -9 while starting")


def _policy(out: Path, cut: str | None = None) -> Path:
    cfg = load_config("scalerl-cpu").model
    out.mkdir()
    (out / "config.json").write_text(json.dumps(family(cfg).hf_config(cfg)))
    tensors = {name: torch.zeros(shape) for name, shape in hf_shapes(cfg, canonical_shapes(cfg).items()).items()}
    if cut is not None:
        tensors[cut] = tensors[cut][:, :-1].contiguous()
    save_file(tensors, out / "model.safetensors")
    return out


def test_an_engine_that_failed_on_a_misshapen_tensor_is_explained_by_name(tmp_path: Path) -> None:
    run = load_config("scalerl-cpu")
    bad = _policy(tmp_path / "bad", cut="model.layers.0.self_attn.o_proj.weight")
    with pytest.raises(ConfigError, match=r"shape mismatches: model\.layers\.0\.self_attn\.o_proj\.weight") as info:
        asyncio.run(_engines_started(FailingEngines(), run, bad))  # type: ignore[arg-type]
    assert isinstance(info.value.__cause__, EngineUnavailableError)


def test_an_engine_that_failed_on_a_sound_model_keeps_its_own_error(tmp_path: Path) -> None:
    run = load_config("scalerl-cpu")
    with pytest.raises(EngineUnavailableError, match="exited with code -9 while starting"):
        asyncio.run(_engines_started(FailingEngines(), run, _policy(tmp_path / "good")))  # type: ignore[arg-type]
