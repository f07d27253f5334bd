"""Run metrics: the JSONL file the scaling toolkit reads, wandb, and one console line per step.

Every row carries `step` and `device_hours`, the cumulative compute of all devices of the run (trainer
ranks + generator devices, times wall-clock hours; on CPU runs each core counts as a device and the
header says so): the x-axis of the scaling law. Validation rows add `val/pass_rate` (mean@k over all
tasks) and `val/pass_rate/<task>`; downstream rows add `downstream/<benchmark>/mean@<n>`, `.../pass@<k>` and
their `_se` (rollout/evaluation.py). The first line of the file is a header `{"run": {...}}` with the run's
name, recipe, model and device kind.

The per-step metrics of docs/recipe.md §2 are logged as `train/truncation_rate`, `train/mismatch` (mean |log
pi_train - log pi_gen| on loss tokens), `train/clip_frac` (share of loss tokens whose ratio was truncated or
clipped), `train/entropy`, `train/staleness_mean` / `_max`, `train/effective_groups`, `train/reward`,
`train/response_length`, and for the generator/trainer mismatch `train/mismatch_kl` (the k3 estimate of
KL(pi_gen || pi_train) per loss token) and `train/mismatch_masked` (sequences left out by `algo.mismatch_mask`).
MoE runs with routing records add `train/routing_agreement` (share of routed tokens whose expert set the trainer
chose as the generator did, all MoE layers), `train/routing_agreement_min` (the lowest layer's) and
`train/routing_agreement/layerNN`: the trainer's own choices, counterfactual under replay. Beside them
`train/routing_replayed` says whether replay happened: the share of routed tokens whose experts were taken from
the generator's records (1.0 with `algo.routing_replay=rollout`, 0.0 with `measure`; trainer/routing.py).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from megatron_rl.config import LoggingConfig


class ComputeClock:
    """Cumulative device-hours: devices x wall time, continued across resumes."""

    def __init__(self, devices: int, start_hours: float = 0.0) -> None:
        self.devices = devices
        self.start_hours = start_hours
        self.t0 = time.monotonic()

    @property
    def device_hours(self) -> float:
        return self.start_hours + self.devices * (time.monotonic() - self.t0) / 3600.0


# (metric, console label, format) for the one-line step summary.
CONSOLE_FIELDS = [
    ("train/reward", "reward", "{:+.3f}"),
    ("train/pass_rate", "pass", "{:.2f}"),
    ("val/pass_rate", "val", "{:.3f}"),
    ("train/loss", "loss", "{:+.4f}"),
    ("train/grad_norm", "gnorm", "{:.3f}"),
    ("train/truncation_rate", "trunc", "{:.1%}"),
    ("train/mismatch", "|dlogp|", "{:.4f}"),
    ("train/mismatch_kl", "kl", "{:.1e}"),
    ("train/routing_agreement", "route", "{:.1%}"),
    ("train/routing_agreement_min", "route-min", "{:.1%}"),
    ("train/routing_replayed", "replayed", "{:.1%}"),
    ("train/staleness_mean", "stale", "{:.2f}"),
    ("train/effective_groups", "groups", "{:.0f}"),
    ("tools/calls_per_trajectory", "calls", "{:.2f}"),  # runs whose prompts call tools
    ("tools/errors", "tool-err", "{:.0f}"),
    ("time/step_s", "s", "{:.1f}"),
    ("device_hours", "dev-h", "{:.4f}"),
]


def console_line(step: int, row: dict[str, Any]) -> str:
    parts = [f"step {step:5d}"]
    for key, label, fmt in CONSOLE_FIELDS:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            parts.append(f"{label} {fmt.format(value)}")
            if key == "val/pass_rate":  # downstream benchmarks beside validation, on the steps they ran
                parts += [f"{name} {value:.3f}" for name, value in _downstream(row)]
    return " | ".join(parts)


def _downstream(row: dict[str, Any]) -> list[tuple[str, float]]:
    """(benchmark, mean@n) of each `downstream/<benchmark>/mean@<n>` in the row."""
    out = []
    for key, value in row.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "downstream" and parts[2].startswith("mean@") and "_" not in parts[2]:
            out.append((parts[1], float(value)))
    return out


class MetricsLogger:
    """The run's metrics file (a header line, then one JSON row per step), wandb and the console line.

    `resume_step`: the step the run continues from (0 for a fresh start). Rows an earlier process logged
    after that step (it died before its next checkpoint, so those steps run again) are removed, as is a
    torn last line, so that no step appears twice; the file is rewritten atomically and what was removed
    is printed. `wandb_run`: the run's wandb run if already started (`start_wandb`); else it starts here."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        header: dict[str, Any],
        config: dict[str, Any],
        resume_step: int = 0,
        wandb_run: Any = None,
    ) -> None:
        self.cfg = cfg
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        lines = [json.dumps({"run": header})]
        self._marks: set[str] = set()
        if self.path.exists():
            lines = _continued(self.path, resume_step, lines[0])
            self._marks = {line for line in lines if '"config_change"' in line}
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in lines))
            os.replace(tmp, self.path)
            self.file = self.path.open("a")
        else:
            self.file = self.path.open("w")
            self.file.write(lines[0] + "\n")
            self.file.flush()
        self.wandb = wandb_run if wandb_run is not None else start_wandb(cfg, run_dir, header.get("name"), config)

    def mark(self, record: dict[str, Any]) -> None:
        """An event record between the step rows (a resume's `config_change`), in the file only; one already there
        (the same change, recorded by a start that died before its next checkpoint) is not written twice."""
        line = json.dumps(record)
        if line not in self._marks:
            self.file.write(line + "\n")
            self.file.flush()
            self._marks.add(line)

    def log(self, step: int, row: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in row.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if self.cfg.console_every_steps and step % self.cfg.console_every_steps == 0:
            print(console_line(step, row), flush=True)

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            import wandb

            self.wandb.finish()
            # wandb's service process otherwise lives until this interpreter's exit; the run's clean shutdown
            # would find it still running (and end it, which makes wandb's own exit hook fail).
            wandb.teardown()


def start_wandb(cfg: LoggingConfig, run_dir: Path, name: str | None, config: dict[str, Any]) -> Any:
    """The run's wandb run, None when disabled. `wandb.init` takes ~1 s (it starts wandb's service process): the
    training driver calls this in a thread while the trainer and engines start."""
    if cfg.wandb == "disabled":
        return None
    import wandb

    run_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        mode=cfg.wandb,
        project=cfg.project,
        name=name,
        dir=str(run_dir),
        config=config,
        resume="allow",
        id=(name or "run").replace("/", "-"),
    )


def end_wandb(wandb_run: Any) -> None:
    """Finish a wandb run the driver started and never handed to a MetricsLogger (its start failed)."""
    if wandb_run is not None:
        import wandb

        wandb_run.finish(exit_code=1)
        wandb.teardown()


def _continued(path: Path, resume_step: int, header: str) -> list[str]:
    """The lines of an existing metrics file that a run continuing from `resume_step` keeps: its header (this
    run's when starting afresh) and the rows up to that step; unreadable lines and later rows are dropped."""
    kept, dropped, torn = [], 0, 0
    old_header = None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            torn += 1
            print(f"metrics: {path}:{number}: not JSON (a write cut short), dropped", flush=True)
            continue
        if isinstance(record, dict) and "run" in record:
            old_header = old_header or line
        elif isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= resume_step:
            kept.append(line)
        else:
            dropped += 1
    if resume_step == 0:
        kept, dropped = [], dropped + len(kept)
    if dropped:
        print(f"metrics: {path}: {dropped} rows after step {resume_step} dropped (they run again)", flush=True)
    return [old_header if resume_step and old_header else header, *kept]


def _plain(value: Any) -> Any:
    """JSON-safe scalars: tensors and numpy numbers become floats; NaN/inf become null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The step rows of a metrics file (the header line is skipped)."""
    rows = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "run" not in record:
            rows.append(record)
    return rows
