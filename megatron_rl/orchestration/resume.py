"""The resume contract: a start that finds a checkpoint continues the same experiment, with the settings a user may
change mid-run applied, or refuses before anything starts.

    change = check_resume(run, checkpoint)    # None, or the fields changed on purpose (logged at the resume step)

Every checkpoint records the resolved config it was saved under (`run` in its megatron_rl.json; older checkpoints:
the run directory's config.yaml, written by the start that saved them). A start that resumes compares the two
field by field:

- **Adjustable** (`ADJUSTABLE`): what a user changes on purpose in a long run without making it another experiment:
  the learning rate and its schedule and the other optimizer hyper-parameters (applied after the optimizer state
  loads), total steps, evaluation, checkpoint and logging cadence, compute accounting, the engines (count, TP,
  memory, arguments), the weight push's transport and timeouts, retries and other timeouts, reward worker counts,
  the data-parallel size (the optimizer state is saved dp-reshardable) and the trainer's memory settings (micro-batch
  size, log-prob chunk, recompute, fusions). The change is printed, written into metrics.jsonl as a
  `config_change` record at the resume step, and marked on the fitted curves.
- **Refused** (everything else): the model, its starting checkpoint and warm-up, the batch shape, the loss and every
  other algorithm setting, sampling and length budgets, the data, rewards, seeds, precision, and the parallel layout
  the optimizer state cannot be resharded across (TP, PP, EP, expert TP, CP). The start stops in one line naming
  the fields, with the two ways out: another run name (`name=...`), or `--fork RUN` (a new run that starts from the
  latest checkpoint of RUN's weights, with its own fresh optimizer, data order and step count).

A dataset whose rows changed under the same config (a file edited or replaced) is refused the same way, by the
fingerprint of its prompts the checkpoint records (`data_fingerprints`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config import ConfigError, RunConfig, to_dict

ADJUSTABLE: tuple[str, ...] = (
    "total_steps",
    "trainer.optimizer.lr",
    "trainer.optimizer.warmup_steps",
    "trainer.optimizer.weight_decay",
    "trainer.optimizer.grad_clip",
    "trainer.optimizer.adam_beta1",
    "trainer.optimizer.adam_beta2",
    "trainer.optimizer.adam_eps",
    "trainer.micro_batch_tokens",
    "trainer.logprob_chunk_mib",
    "trainer.recompute",
    "trainer.performance",
    "parallel.trainer_devices",
    "parallel.sequence_parallel",
    "model.layout",
    "rollout.engine.num_engines",
    "rollout.engine.tp",
    "rollout.engine.mem_fraction",
    "rollout.engine.extra_args",
    "rollout.engine.ready_timeout_s",
    "rollout.weight_sync",
    "rollout.sync_bucket_mb",
    "rollout.sync_timeout_s",
    "rollout.max_retries",
    "rewards.processes",
    "rewards.math_timeout_s",
    "rewards.sandbox.wall_time_s",
    "rewards.sandbox.cpu_time_s",
    "rewards.sandbox.workers",
    "algo.max_empty_batches",
    "eval",
    "logging",
    "checkpoint",
    "compute",
)
"""Dotted config fields (or whole sections) a resume applies and logs instead of refusing."""

IDENTITY = ("name", "output_dir", "recipe", "checkpoint.fork_from")
"""Where the run lives, what its recipe file was called and where a fork started it: not compared (the fields the
recipe set are; a forked run's restart resumes its own checkpoints with or without `--fork`)."""


@dataclass
class ConfigChange:
    """The adjustable fields a resumed run changed: dotted name -> (value at the checkpoint, value now)."""

    step: int
    fields: dict[str, tuple[Any, Any]]

    def describe(self) -> str:
        return ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in self.fields.items())

    def record(self) -> dict[str, Any]:
        """The metrics.jsonl record: {"step": N, "config_change": {field: [old, new]}}."""
        return {"step": self.step, "config_change": {key: [old, new] for key, (old, new) in self.fields.items()}}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested config dicts as dotted fields; a list of sections (`data.datasets`) indexed (`data.datasets[0].source`),
    other lists kept whole."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(tree, list) and tree and all(isinstance(item, dict) for item in tree):
        out = {f"{prefix}.count": len(tree)}
        for i, item in enumerate(tree):
            out.update(flatten(item, f"{prefix}[{i}]"))
        return out
    return {prefix: tree}


def adjustable(key: str) -> bool:
    return any(key == field or key.startswith(field + ".") for field in ADJUSTABLE)


def saved_config(checkpoint: Path) -> dict[str, Any] | None:
    """The resolved config `checkpoint` was saved under: its megatron_rl.json's `run`, else the run directory's
    config.yaml (checkpoints written before configs were recorded in them); None if neither exists."""
    meta = checkpoint / "megatron_rl.json"
    if meta.is_file():
        recorded = json.loads(meta.read_text()).get("run")
        if isinstance(recorded, dict):
            return recorded
    config = checkpoint.parent.parent / "config.yaml"
    if config.is_file():
        loaded = yaml.safe_load(config.read_text())
        return loaded if isinstance(loaded, dict) else None
    return None


def saved_step(checkpoint: Path) -> int:
    meta = checkpoint / "megatron_rl.json"
    return int(json.loads(meta.read_text()).get("step", 0)) if meta.is_file() else 0


def check_resume(run: RunConfig, checkpoint: Path, fork: bool = False) -> ConfigChange | None:
    """Compare `run` with the config `checkpoint` was saved under: the adjustable fields that changed (None if
    none), or ConfigError naming the fields that would make the resumed run another experiment. With `fork` (a new
    run from that checkpoint's weights) only the model must agree: its architecture fields."""
    saved = saved_config(checkpoint)
    if saved is None:
        return None
    before, now = flatten(saved), flatten(json.loads(json.dumps(to_dict(run))))  # tuples as saved: lists
    changed = {
        key: (before[key], now[key])
        for key in sorted(before.keys() & now.keys())
        if before[key] != now[key] and key not in IDENTITY and key.split(".")[0] not in IDENTITY
    }
    if fork:
        model = {k: v for k, v in changed.items() if k.startswith("model.") and not k.startswith("model.layout")}
        model.pop("model.hf_path", None)
        if model:
            raise ConfigError(
                f"--fork: {checkpoint} holds another model than this run's: "
                + ", ".join(f"{key} (checkpoint {old!r}, now {new!r})" for key, (old, new) in model.items())
            )
        return None
    refused = {key: values for key, values in changed.items() if not adjustable(key)}
    if refused:
        fields = ", ".join(f"{key} ({old!r} -> {new!r})" for key, (old, new) in refused.items())
        raise ConfigError(
            f"{checkpoint} was saved by another experiment than this config describes: {fields}. A resume continues "
            f"the same run; start a new one with another name (name=...), or with --fork "
            f"{checkpoint.parent.parent} to start a new run (name=...) from this checkpoint's weights"
        )
    return ConfigChange(saved_step(checkpoint), changed) if changed else None


def fork_source(run: RunConfig) -> Path:
    """The checkpoint `checkpoint.fork_from` names: a run directory's latest, a checkpoints directory's latest, or one
    checkpoint (verified against its manifest, as a resume's is)."""
    from megatron_rl.trainer.checkpoint import latest_checkpoint

    assert run.checkpoint.fork_from
    path = Path(run.checkpoint.fork_from)
    if (path / "megatron_rl.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        if root.is_dir() and (found := latest_checkpoint(root)) is not None:
            return found
    raise ConfigError(f"checkpoint.fork_from (--fork): {path} holds no checkpoint (a run directory or a checkpoint)")


def check_data(fingerprints: dict[str, str], checkpoint: Path) -> None:
    """The training data's fingerprints against those `checkpoint` recorded: a dataset whose prompts changed under
    the same config is refused (the sampler's state indexes its rows)."""
    meta = checkpoint / "megatron_rl.json"
    recorded = json.loads(meta.read_text()).get("data_fingerprints") if meta.is_file() else None
    if not recorded:
        return
    differs = sorted(key for key in recorded.keys() & fingerprints.keys() if recorded[key] != fingerprints[key])
    if differs:
        raise ConfigError(
            f"data.datasets: the prompts of {', '.join(differs)} changed since {checkpoint} was saved (the run's data "
            "order and curriculum index them); restore the data, or start a new run (name=...), or --fork "
            f"{checkpoint.parent.parent} to train on the new data from this checkpoint's weights"
        )
