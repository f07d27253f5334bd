"""Hugging Face <-> Megatron conversion: one name/shape mapping per model family, used three ways.

    to_hf(name, tensor, cfg)            canonical megatron tensor -> [(HF name, tensor)]   (sync, export)
    from_hf(get, cfg)                   HF tensors (fetched lazily by name) -> canonical megatron tensors
    load_hf_into_model(model, cfg, d)   import: stream an HF directory into this rank's shards
    iter_hf_weights(model, cfg, bytes)  the trainer's full weights under HF names, in buckets (weight sync)

Canonical megatron names are defined in trainer/weights.py (TP=PP=EP=1, global layer/expert indices).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor

from megatron_rl.config import ModelConfig
from megatron_rl.convert import dense

FAMILIES: dict[str, ModuleType] = {"llama": dense, "qwen3": dense}


def family(cfg: ModelConfig) -> ModuleType:
    if cfg.family not in FAMILIES:
        raise ValueError(f"model.family: no conversion for {cfg.family!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[cfg.family]


def to_hf(name: str, tensor: Tensor, cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    return family(cfg).to_hf(name, tensor, cfg)


def from_hf(get: Callable[[str], Tensor], cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    return family(cfg).from_hf(get, cfg)


class SafetensorsReader:
    """Lazy access to an HF directory's tensors by name (single file or sharded index)."""

    def __init__(self, hf_dir: Path) -> None:
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").exists():
            with safe_open(self.dir / "model.safetensors", "pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or model.safetensors.index.json")
        self.weight_map: dict[str, str] = weight_map
        self.used: set[str] = set()
        self._open: dict[str, Any] = {}

    def __call__(self, name: str) -> Tensor:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {name!r} not found in the checkpoint")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(self.dir / file, "pt")
        self.used.add(name)
        return self._open[file].get_tensor(name)

    def unused(self) -> list[str]:
        return sorted(set(self.weight_map) - self.used)


def load_hf_into_model(model: Any, cfg: ModelConfig, hf_dir: Path) -> None:
    """Import: stream the HF checkpoint's tensors into this rank's shards of `model`."""
    from megatron_rl.trainer.weights import load_full_weights

    reader = SafetensorsReader(hf_dir)
    load_full_weights(model, from_hf(reader, cfg))
    extra = [n for n in reader.unused() if not n.endswith("rotary_emb.inv_freq")]
    if extra:
        raise ValueError(f"{hf_dir}: tensors not used by the {cfg.family} mapping: {extra}")
