"""Typed run configuration: dataclasses, YAML recipes, dotted overrides, validation.

This package owns the shape of a megatron_rl run, one module per section (model, trainer, algo, rollout, data,
evaluation; run: the whole, with the checks that span sections; building and loading: from YAML and overrides),
all importable from here. A run is one `RunConfig`, built from

    recipe YAML (with `base:` inheritance)  ->  model config YAML (model_configs/)  ->  dotted overrides

and validated on construction: every error names the dotted field to change and, for a choice, the
allowed values. The resolved config is written into the run directory (`save_config`).

Defaults are the ScaleRL recipe of docs/recipe.md (the paper's values); choices the paper leaves
open are marked "(ours)" in the field docstrings.

This package imports no torch, Megatron, SGLang or Ray (tests/integration/test_config.py proves it): the CLI,
the Slurm launcher and the recipe checks parse configs without paying for heavy imports.
"""

from __future__ import annotations

from megatron_rl.config.algo import AlgoConfig, LengthPenaltyConfig
from megatron_rl.config.building import build, to_dict
from megatron_rl.config.data import DataConfig, DatasetConfig, RewardsConfig, SandboxConfig
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.evaluation import DOWNSTREAM_BENCHMARKS, BenchmarkConfig, DownstreamConfig, EvalConfig
from megatron_rl.config.loading import (
    MODEL_CONFIGS_DIR,
    PACKAGE_DIR,
    RECIPES_DIR,
    apply_overrides,
    list_model_configs,
    list_recipes,
    load_config,
    load_model_dict,
    load_recipe_dict,
    load_resolved,
    save_config,
)
from megatron_rl.config.model import ModelConfig, MoEConfig, ParallelLayout
from megatron_rl.config.rollout import (
    PHRASE_TOKEN_ALLOWANCE,
    EngineConfig,
    InterruptionConfig,
    RolloutConfig,
    SamplingConfig,
    ToolsConfig,
)
from megatron_rl.config.run import CheckpointConfig, ComputeConfig, LoggingConfig, RunConfig
from megatron_rl.config.trainer import (
    GPU_IMAGE_HAS_APEX,
    RECOMPUTE_MODULES,
    OptimizerConfig,
    ParallelConfig,
    PerformanceConfig,
    RecomputeConfig,
    TrainerConfig,
    check_norm_recompute,
)

__all__ = [
    "AlgoConfig",
    "BenchmarkConfig",
    "CheckpointConfig",
    "ComputeConfig",
    "ConfigError",
    "DOWNSTREAM_BENCHMARKS",
    "DataConfig",
    "DatasetConfig",
    "DownstreamConfig",
    "EngineConfig",
    "EvalConfig",
    "GPU_IMAGE_HAS_APEX",
    "InterruptionConfig",
    "LengthPenaltyConfig",
    "LoggingConfig",
    "MODEL_CONFIGS_DIR",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PACKAGE_DIR",
    "PHRASE_TOKEN_ALLOWANCE",
    "ParallelConfig",
    "ParallelLayout",
    "PerformanceConfig",
    "RECIPES_DIR",
    "RECOMPUTE_MODULES",
    "RecomputeConfig",
    "RewardsConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "ToolsConfig",
    "SandboxConfig",
    "TrainerConfig",
    "apply_overrides",
    "build",
    "check_norm_recompute",
    "list_model_configs",
    "list_recipes",
    "load_config",
    "load_model_dict",
    "load_recipe_dict",
    "load_resolved",
    "save_config",
    "to_dict",
]
