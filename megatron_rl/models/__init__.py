"""The model families: one module per family, each mapping megatron's tensors to Hugging Face names and back.

    family(cfg)                       the family module of a ModelConfig (llama, qwen3, qwen3_moe, llama4)
    family_of(config_json)            our family name for an HF config.json (by `model_type`)
    model_config_from_hf(hf_dir)      the ModelConfig of an HF checkpoint directory
    HFMapper(cfg).map_all(named)      canonical megatron tensors in, HF tensors out (fused ones assembled)
    from_hf(cfg)                      FromHF recipes: every canonical tensor <- the HF tensors it reads
    hf_plan(cfg, canonical)           (HF name, shape, dtype) of a weight stream, on the meta device

This package sits below both the trainer (weight sync publishes under HF names, trainer/weights.py) and
the converter (import and export, convert/), so a tensor that syncs correctly also exports correctly.

Family modules (llama, qwen3, qwen3_moe, llama4) each define

    MODEL_TYPES                       config.json `model_type` values they read
    check(cfg)                        ValueError for settings the family cannot express
    to_hf(name, tensor, cfg)          canonical megatron tensor -> [(HF name, tensor or Stacked part)]
    from_hf(cfg)                      FromHF recipes: canonical tensor <- the HF tensors it reads
    hf_config(cfg) / model_config(hf) ModelConfig -> config.json arguments, and back

and optionally `checkpoint_prefix(names)`, `skipped(hf_name)`, `text_config(hf)` (Llama-4's multimodal
Hub checkpoint), `engine_to_hf(name, tensor, cfg)` (the engines' weight-update names where they differ).
Canonical megatron names are defined in trainer/weights.py (TP=PP=EP=1, global layer and expert indices,
local-spec norm names). `tiny.py` builds a random HF checkpoint of any family.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from megatron_rl.config import ModelConfig
from megatron_rl.models import layers, llama, llama4, qwen3, qwen3_moe
from megatron_rl.models.layers import FromHF, HFTensors, Stacked

if TYPE_CHECKING:  # torch is imported where tensors are touched: the driver checks a config.json without it
    import torch
    from torch import Tensor

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen3": qwen3, "qwen3_moe": qwen3_moe, "llama4": llama4}


def family(cfg: ModelConfig | str) -> ModuleType:
    name = cfg if isinstance(cfg, str) else cfg.family
    if name not in FAMILIES:
        raise ValueError(f"model.family: no conversion for {name!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of(hf_config: dict[str, Any]) -> str:
    """Our family name for a config.json (by `model_type`)."""
    model_type = hf_config.get("model_type")
    for name, module in FAMILIES.items():
        if model_type in module.MODEL_TYPES:
            return name
    known = sorted(t for m in FAMILIES.values() for t in m.MODEL_TYPES)
    architectures = hf_config.get("architectures")
    raise ValueError(
        f"config.json: unknown architecture (model_type {model_type!r}, architectures {architectures}); "
        f"supported model types: {known}"
    )


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json")
    return json.loads(path.read_text())


def model_config_from_hf(hf_dir: str | Path, name: str | None = None) -> ModelConfig:
    """The ModelConfig of an HF checkpoint directory, from its config.json."""
    hf = read_hf_config(hf_dir)
    module = family(family_of(hf))
    cfg: ModelConfig = module.model_config(hf, name or Path(hf_dir).name)
    cfg.hf_path = str(hf_dir)
    return cfg


def to_hf(name: str, tensor: Tensor, cfg: ModelConfig, engine: bool = False) -> HFTensors:
    """One canonical tensor under HF names; fused HF tensors come as `Stacked` parts (use HFMapper).

    `engine`: the names the engines' loader takes in a weight update, where a family's differ from its
    checkpoint's (`engine_to_hf`: Llama-4's experts one by one instead of fused per layer)."""
    module = family(cfg)
    if engine and hasattr(module, "engine_to_hf"):
        return module.engine_to_hf(name, tensor, cfg)  # type: ignore[no-any-return]
    return module.to_hf(name, tensor, cfg)  # type: ignore[no-any-return]


def from_hf(cfg: ModelConfig) -> Iterator[FromHF]:
    """The recipes that build every canonical tensor of `cfg` from HF tensors."""
    module = family(cfg)
    module.check(cfg)
    return module.from_hf(cfg)  # type: ignore[no-any-return]


class HFMapper:
    """Canonical tensors in, HF tensors out: `to_hf` plus assembly of fused (stacked) HF tensors.

    A stacked tensor (Llama-4's per-layer experts) is emitted when its last part arrives, so the mapper
    holds at most the stacks being filled; `finish()` raises if one is incomplete.
    """

    def __init__(self, cfg: ModelConfig, engine: bool = False) -> None:
        family(cfg).check(cfg)
        self.cfg = cfg
        self.engine = engine
        """Map to the engines' weight-update names (`to_hf(engine=True)`) instead of the checkpoint's."""
        self._stacks: dict[str, list[Tensor | None]] = {}

    def map(self, name: str, tensor: Tensor) -> list[tuple[str, Tensor]]:
        out = []
        for hf_name, value in to_hf(name, tensor, self.cfg, self.engine):
            if not isinstance(value, Stacked):
                out.append((hf_name, value))
                continue
            parts = self._stacks.setdefault(hf_name, [None] * value.count)
            if parts[value.index] is not None:
                raise ValueError(f"{hf_name}: part {value.index} given twice (from {name})")
            parts[value.index] = value.tensor
            if all(p is not None for p in parts):
                import torch

                out.append((hf_name, torch.stack(parts)))  # type: ignore[arg-type]
                del self._stacks[hf_name]
        return out

    def finish(self) -> None:
        if self._stacks:
            incomplete = {name: [i for i, p in enumerate(parts) if p is None] for name, parts in self._stacks.items()}
            raise ValueError(f"incomplete stacked HF tensors (name: missing parts): {incomplete}")

    def map_all(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, tensor in named:
            yield from self.map(name, tensor)
        self.finish()


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of `cfg` with its full shape, from the config alone (no model, no files)."""
    return {recipe.name: layers.canonical_shape(recipe.name, cfg) for recipe in from_hf(cfg)}


def hf_plan(
    cfg: ModelConfig, canonical: Iterable[tuple[str, tuple[int, ...], torch.dtype]]
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, shape, dtype), in emission order, for canonical tensors given in order; nothing is allocated."""
    import torch

    mapper = HFMapper(cfg)
    meta = ((name, torch.empty(shape, dtype=dtype, device="meta")) for name, shape, dtype in canonical)
    return [(name, tuple(t.shape), t.dtype) for name, t in mapper.map_all(meta)]


def hf_shapes(cfg: ModelConfig, canonical: Iterable[tuple[str, tuple[int, ...]]]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape for canonical (name, shape) pairs."""
    import torch

    return {name: shape for name, shape, _ in hf_plan(cfg, ((n, s, torch.float32) for n, s in canonical))}


__all__ = [
    "FAMILIES",
    "FromHF",
    "HFMapper",
    "Stacked",
    "canonical_shapes",
    "family",
    "family_of",
    "from_hf",
    "hf_plan",
    "hf_shapes",
    "model_config_from_hf",
    "read_hf_config",
    "to_hf",
]
