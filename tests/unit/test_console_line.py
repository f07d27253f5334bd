"""The one-line step summary shows the metrics the run logs (a renamed metric would silently vanish from it)."""

from __future__ import annotations

import re
from pathlib import Path

import megatron_rl
from megatron_rl.metrics import CONSOLE_FIELDS, console_line
from megatron_rl.rollout.pipeline import BatchStats, tool_metrics
from megatron_rl.rollout.trajectory import ToolStats


def _logged_names() -> set[str]:
    """Metric names a step row carries: the batch statistics, the train step's (read from its source: it needs
    megatron-core to run), validation's, and the compute clock."""
    step_source = (Path(megatron_rl.__file__).parent / "trainer" / "step.py").read_text()
    trainer = set(re.findall(r'"(train/[a-z_/]+)":', step_source))
    assert {"train/loss", "train/mismatch", "train/clip_frac"} <= trainer
    tools = set(tool_metrics([(ToolStats(calls=1, turns=2), True), (ToolStats(turns=1), False)]))  # tool runs
    return set(BatchStats().as_metrics()) | tools | trainer | {"val/pass_rate", "time/step_s", "device_hours"}


def test_every_console_field_is_a_logged_metric():
    missing = [key for key, _, _ in CONSOLE_FIELDS if key not in _logged_names()]
    assert not missing, f"console fields no step row carries: {missing}"


def test_the_step_line_shows_the_logprob_mismatch():
    line = console_line(7, {"train/mismatch": 0.0123, "train/reward": 0.5, "train/loss": float("nan")})
    assert line.startswith("step     7") and "|dlogp| 0.0123" in line and "reward +0.500" in line and "loss" not in line


def test_the_step_line_shows_whether_routing_was_replayed_beside_the_agreement():
    """The agreement is the trainer's own routing, counterfactual under replay: the line also says what was used."""
    row = {"train/routing_agreement": 0.873, "train/routing_agreement_min": 0.81, "train/routing_replayed": 1.0}
    assert "route 87.3% | route-min 81.0% | replayed 100.0%" in console_line(3, row)
    assert "replayed 0.0%" in console_line(3, {**row, "train/routing_replayed": 0.0})


def test_a_tool_run_shows_its_calls_and_tool_errors():
    row = {"train/reward": 0.5, **tool_metrics([(ToolStats(calls=2, errors=1, turns=3), True), (ToolStats(), False)])}
    assert "calls 1.00 | tool-err 1" in console_line(4, row)
    assert "calls" not in console_line(4, {"train/reward": 0.5})  # a run without tools: no tool columns
