"""The small run every whole-run test starts from: the CPU recipe (scalerl-cpu, multitask-cpu) at a size that
runs in seconds per step on two cores, with evaluation kept to a few prompts and no downstream benchmarks.

`small_run(*overrides)` is that run's overrides with each test's own settings: an override of a key the small run
sets replaces it in place, a new key is appended, so a test's list reads as what it changes.
"""

from __future__ import annotations

SMALL_RUN = (
    "data.val_prompts=16",
    "eval.every_steps=2",
    "eval.samples_per_prompt=2",
    "eval.downstream.benchmarks=[]",
    "rollout.prompts_per_step=8",
    "rollout.generations_per_prompt=4",
)


def small_run(*overrides: str) -> list[str]:
    settings = dict(override.split("=", 1) for override in SMALL_RUN)
    for override in overrides:
        key, value = override.split("=", 1)
        settings[key] = value
    return [f"{key}={value}" for key, value in settings.items()]
