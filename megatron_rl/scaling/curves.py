"""Training curves in: the metrics JSONL megatron_rl writes, or CSV exports (e.g. from wandb).

The metrics JSONL (megatron_rl/metrics.py) starts with a header `{"run": {...}}` (name, recipe, model,
seed, device kind, and any labels) followed by one object per logged step. The columns used here:

    step                    int    optimizer steps taken
    device_hours            float  cumulative compute of every trainer and generator device (the x-axis)
    val/pass_rate           float  mean@k validation pass rate, only on rows where validation ran (the y-axis)
    val/pass_rate/<task>    float  the same per task (`--metric 'val/pass_rate/*'` fits one curve per task)
    train/...                      per-step training metrics (not used here)

R0 is the first validation point (step 0, before any update). A resumed run logs the steps after its
checkpoint again: the last row of a step wins. CSV files need a header row; `compute_col`, `metric` and
`step_col` name the columns (wandb exports use the metric names as column titles); `compute_scale`
converts the compute column (e.g. 1/3600 for GPU-seconds, or GPU-hours per step for a step column).

Run labels for scaling axes (`label_for`): a dotted key looked up in the header, then in the run's
resolved config (config.yaml next to the metrics file), e.g. `model`, `rollout.generations_per_prompt`.
"""

from __future__ import annotations

import csv
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_rl.scaling.fit import Array, FitError


@dataclass
class Curve:
    label: str
    compute: Array
    R: Array
    source: str
    """The file it came from."""
    metric: str = "val/pass_rate"
    header: dict[str, Any] = field(default_factory=dict)
    steps: Array | None = None
    notes: list[str] = field(default_factory=list)
    """What loading changed or noticed: replaced duplicate steps, R0 not at step 0."""
    runs: Array | None = None
    """Which run each point comes from when repeated runs are pooled (`pool_runs`); None: one run."""
    changes: list[tuple[float, int | None, list[str]]] = field(default_factory=list)
    """Config changes a resume applied mid-run (metrics.jsonl `config_change` records): (compute, step, fields).
    The curve spans both settings; plots mark where."""

    @property
    def n_runs(self) -> int:
        return 1 if self.runs is None else int(np.unique(self.runs).size)


def pool_runs(curves: list[Curve]) -> Curve:
    """Repeated runs of one recipe (same label) as one curve: their points together, `runs` saying which
    run each came from. The fit pools them (R0: the mean of the runs' first points) and the bootstrap
    resamples the runs as well as the noise within each, so the intervals include run-to-run variation."""
    if len(curves) == 1:
        return curves[0]
    sources = [c.source for c in curves]
    if len(set(sources)) < len(sources):
        raise FitError(f"the same file is given twice for {curves[0].label!r}: {sources}")
    notes = [f"{Path(c.source).name}: {note}" for c in curves for note in c.notes]
    return Curve(
        curves[0].label,
        np.concatenate([c.compute for c in curves]),
        np.concatenate([c.R for c in curves]),
        ", ".join(sources),
        curves[0].metric,
        curves[0].header,
        None,
        notes,
        np.concatenate([np.full(c.R.size, i) for i, c in enumerate(curves)]),
        [change for c in curves for change in c.changes],
    )


def _number(value: Any, where: str, column: str) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise FitError(f"{where}: column {column!r} is not a number: {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FitError(f"{where}: column {column!r} is not a number: {value!r}") from None
    if not math.isfinite(number):
        raise FitError(f"{where}: column {column!r} is not finite: {value!r}")
    return number


def _read_rows(path: Path) -> tuple[dict[str, Any], list[tuple[int, dict[str, Any]]], list[str]]:
    """(header, [(line number, row)], columns seen) of a JSONL or CSV file."""
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            rows = [(i + 2, dict(row)) for i, row in enumerate(reader)]
        return {}, rows, columns
    header: dict[str, Any] = {}
    rows = []
    columns: dict[str, None] = {}
    text = path.read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) and not text.endswith("\n"):  # a run killed while writing its last row
                warnings.warn(f"{path}:{i}: a partial last line (a run cut off mid-write) is left out", stacklevel=2)
                break
            raise FitError(f"{path}:{i}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise FitError(f"{path}:{i}: expected a JSON object, got {type(record).__name__}")
        if "run" in record and not rows:
            header = record["run"] if isinstance(record["run"], dict) else {"name": str(record["run"])}
            continue
        rows.append((i, record))
        columns.update(dict.fromkeys(record))
    return header, rows, list(columns)


def _metrics_matching(metric: str, columns: list[str]) -> list[str]:
    if "*" not in metric:
        return [metric]
    if metric.endswith("*") and metric.count("*") == 1:
        prefix = metric[:-1]
        return [c for c in columns if c.startswith(prefix) and len(c) > len(prefix)]
    import fnmatch

    return [c for c in columns if fnmatch.fnmatchcase(c, metric) and not c.endswith("_se")]


def load_curves(
    path: str | Path,
    compute_col: str = "device_hours",
    metric: str = "val/pass_rate",
    label: str | None = None,
    step_col: str = "step",
    compute_scale: float = 1.0,
) -> list[Curve]:
    """The (compute, metric) curves of one run; `metric` ending in `*` gives one curve per matching column
    (`val/pass_rate/*`: one per task), a `*` elsewhere one per column it matches (`downstream/*/mean@16`: one per
    benchmark). Rows without the metric are skipped (validation and downstream evaluation are periodic)."""
    path = Path(path)
    if not path.is_file():
        raise FitError(f"{path}: no such file")
    header, rows, columns = _read_rows(path)
    if not rows:
        raise FitError(f"{path}: no data rows")
    if compute_col not in columns:
        raise FitError(f"{path}: column {compute_col!r} missing (set the compute column); columns are {columns}")
    metrics = _metrics_matching(metric, columns)
    missing = [m for m in metrics if m not in columns]
    if missing or not metrics:
        near = [c for c in columns if c.startswith("val/")] or columns
        raise FitError(f"{path}: column {metric!r} missing; columns are {near}")
    name = label or str(header.get("name") or path.stem)
    changes = _config_changes(rows, compute_col, step_col, compute_scale)
    curves = []
    for m in metrics:
        curve = _curve(path, rows, compute_col, m, step_col if step_col in columns else None, compute_scale)
        if len(metrics) == 1:
            curve.label = name
        else:
            curve.label = f"{name} {m[len(metric) - 1 :] if metric.endswith('*') and metric.count('*') == 1 else m}"
        curve.header = header
        curve.changes = changes
        curve.notes += [
            f"config changed at step {step} ({compute_col} {c:g}): {', '.join(fields)}; the curve spans both settings"
            for c, step, fields in changes
        ]
        curves.append(curve)
    return curves


def _config_changes(
    rows: list[tuple[int, dict[str, Any]]], compute_col: str, step_col: str, compute_scale: float
) -> list[tuple[float, int | None, list[str]]]:
    """The `config_change` records a resume wrote (orchestration/resume.py): (compute, step, changed fields)."""
    out = []
    for _, row in rows:
        change = row.get("config_change")
        compute = row.get(compute_col)
        if isinstance(change, dict) and isinstance(compute, (int, float)):
            out.append((float(compute) * compute_scale, row.get(step_col), sorted(change)))
    return out


def load_curve(path: str | Path, compute_col: str = "device_hours", metric: str = "val/pass_rate", **kw: Any) -> Curve:
    """The single curve of `metric` in one run's file (see `load_curves`)."""
    curves = load_curves(path, compute_col, metric, **kw)
    if len(curves) != 1:
        raise FitError(f"{path}: {metric!r} matches {len(curves)} columns; use load_curves")
    return curves[0]


def _curve(
    path: Path,
    rows: list[tuple[int, dict[str, Any]]],
    compute_col: str,
    metric: str,
    step_col: str | None,
    compute_scale: float,
) -> Curve:
    by_step: dict[float, tuple[int, float, float]] = {}
    points: list[tuple[int, float, float]] = []
    replaced = 0
    for line, row in rows:
        value = _number(row.get(metric), f"{path}:{line}", metric)
        if value is None:
            continue
        c = _number(row.get(compute_col), f"{path}:{line}", compute_col)
        if c is None:
            raise FitError(f"{path}:{line}: column {compute_col!r} missing on a row that has {metric!r}")
        if c < 0:
            raise FitError(f"{path}:{line}: column {compute_col!r} is negative: {c}")
        step = _number(row.get(step_col), f"{path}:{line}", step_col) if step_col else None
        if step is None:
            points.append((line, c * compute_scale, value))
        else:
            replaced += step in by_step
            by_step[step] = (line, c * compute_scale, value)  # a resumed run re-logs steps: the last wins
    notes = []
    steps = None
    if by_step:
        order = sorted(by_step)
        if points:
            raise FitError(f"{path}:{points[0][0]}: column {step_col!r} missing on a row that has {metric!r}")
        points = [by_step[s] for s in order]
        steps = np.asarray(order)
        for (line_a, c_a, _), (line_b, c_b, _) in zip(points, points[1:], strict=False):
            if c_b < c_a:
                raise FitError(
                    f"{path}:{line_b}: {compute_col!r} decreases with {step_col!r} ({c_a:g} at line {line_a}, "
                    f"{c_b:g} here): compute must be cumulative"
                )
        if replaced:
            notes.append(f"{replaced} re-logged steps (a resumed run): the last row of each step was used")
        if steps[0] > 1:
            notes.append(f"the first {metric!r} point is at step {steps[0]:g}, not 0: R0 is not the initial pass rate")
    else:
        points.sort(key=lambda p: p[1])
    if not points:
        raise FitError(f"{path}: no rows with {metric!r}")
    compute = np.array([p[1] for p in points])
    R = np.array([p[2] for p in points])
    return Curve(path.stem, compute, R, str(path), metric, {}, steps, notes)


def label_for(curve: Curve, key: str) -> str:
    """The value of a dotted `key` for this run: in the metrics header (`model`, `labels.batch`, ...), else
    in the resolved config written next to the metrics file (`rollout.generations_per_prompt`, ...)."""
    value = _dotted(curve.header, key)
    config = Path(curve.source).with_name("config.yaml")
    if value is None and config.is_file():
        import yaml  # a core dependency; only needed to label runs by config fields

        value = _dotted(yaml.safe_load(config.read_text()) or {}, key)
    if value is None:
        raise FitError(
            f"{curve.source}: label key {key!r} is neither in its header nor in {config}; "
            "name the run on the command line instead (label=path)"
        )
    return str(value)


def _dotted(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def sort_key(label: str) -> tuple[int, float, str]:
    """Numeric labels in numeric order (batch 512 < 2048), others alphabetically after them."""
    digits = label.rstrip("kKmMbB")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9}.get(label[len(digits) :].lower()[:1], 1.0)
    try:
        return 0, float(digits) * scale, label
    except ValueError:
        return 1, 0.0, label
