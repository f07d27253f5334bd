"""YAML recipes (with `base:` inheritance), model configs and dotted overrides, into one checked `RunConfig`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.building import build, to_dict
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.model import ParallelLayout
from megatron_rl.config.run import RunConfig

PACKAGE_DIR = Path(__file__).resolve().parents[1]
RECIPES_DIR = PACKAGE_DIR / "recipes"
MODEL_CONFIGS_DIR = PACKAGE_DIR.parent / "model_configs"


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def list_model_configs() -> list[str]:
    return sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.yaml"))


def _resolve(name_or_path: str, directory: Path, what: str, known: list[str]) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = directory / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    raise ConfigError(f"{what}: no such {what} {name_or_path!r}; known: {known} (or give a path to a .yaml file)")


def load_recipe_dict(name_or_path: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """A recipe's settings with its `base:` chain merged in (base first, the recipe on top)."""
    path = _resolve(name_or_path, RECIPES_DIR, "recipe", list_recipes())
    if path.stem in _seen:
        raise ConfigError(f"recipe: `base:` cycle {' -> '.join((*_seen, path.stem))}")
    data = _read_yaml(path)
    base = data.pop("base", None)
    data.pop("description", None)
    if base is None:
        return data
    return _deep_merge(load_recipe_dict(str(base), (*_seen, path.stem)), data)


def load_model_dict(name_or_path: str) -> dict[str, Any]:
    path = _resolve(name_or_path, MODEL_CONFIGS_DIR, "model", list_model_configs())
    data = _read_yaml(path)
    data.setdefault("name", path.stem)
    return data


def _parse_scalar(text: str) -> Any:
    """Parse an override's right-hand side as YAML (numbers, booleans, null, lists, quoted strings)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (the result is validated by `build`)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {override!r}: expected the form section.field=value")
        *parents, leaf = key.strip().split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a section")
        node[leaf] = _parse_scalar(text)
    return data


def load_config(recipe: str = "scalerl", model: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """recipe YAML -> model config YAML (`model:` in the recipe, or the argument) -> overrides -> RunConfig."""
    data = load_recipe_dict(recipe)
    data.setdefault("recipe", Path(recipe).stem)
    data.setdefault("name", Path(recipe).stem)
    model_name = model or data.get("model", {}).get("name")
    if model_name:
        recipe_model = data.get("model", {})
        data["model"] = _deep_merge(load_model_dict(model_name), {k: v for k, v in recipe_model.items() if k != "name"})
        data["model"]["name"] = Path(model_name).stem
    data = _layout_defaults(data)
    data = apply_overrides(data, overrides or [])
    return build(RunConfig, data)


def _layout_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The model config's `layout` gives the parallel split and engine count unless the recipe sets them."""
    layout = data.get("model", {}).get("layout")
    if not layout:
        return data
    layout = build(ParallelLayout, layout, prefix="model.layout")
    parallel = {
        "tp": layout.tp,
        "pp": layout.pp,
        "ep": layout.ep,
        "etp": layout.etp,
        "sequence_parallel": layout.sequence_parallel,
        "trainer_devices": layout.trainer_gpus,
    }
    engine = {"tp": layout.generator_tp, "num_engines": max(1, layout.generator_gpus // layout.generator_tp)}
    trainer = {"recompute": {"granularity": layout.recompute}}
    data = _deep_merge({"parallel": parallel, "rollout": {"engine": engine}, "trainer": trainer}, data)
    return data


def save_config(config: RunConfig, path: Path) -> None:
    """Write the resolved config (every field, defaults included) so the run can be reproduced."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def load_resolved(path: Path) -> RunConfig:
    """Read back a config written by `save_config`."""
    return build(RunConfig, _read_yaml(path))
