"""Training curves in: the metrics JSONL megatron_rl writes, or CSV exports (e.g. from wandb).

The metrics JSONL (megatron_rl/metrics.py) starts with a header `{"run": {...}}` (name, recipe, model,
seed, labels) followed by one object per logged step:

    step            int     optimizer steps taken
    device_hours    float   cumulative compute: all trainer + generator devices x wall time (the x-axis)
    val/pass_rate   float   mean@k validation pass rate, on rows where validation ran (the y-axis)
    val/pass_rate/<task>    the same per task (multi-task runs fit one curve per task)
    train/...               per-step training metrics (not used here)

CSV files need a header row; `--compute-col` and `--metric` name the columns (wandb exports use the
metric names as column titles).
"""

from __future__ import annotations

import csv
import json
import math
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
    header: dict[str, Any] = field(default_factory=dict)


def _number(value: Any, where: str, column: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FitError(f"{where}: column {column!r} is not a number: {value!r}") from None
    if not math.isfinite(number):
        raise FitError(f"{where}: column {column!r} is not finite: {value!r}")
    return number


def load_curve(
    path: str | Path, compute_col: str = "device_hours", metric: str = "val/pass_rate", label: str | None = None
) -> Curve:
    """One run's (compute, metric) points; rows without the metric are skipped (validation is periodic)."""
    path = Path(path)
    if not path.exists():
        raise FitError(f"{path}: no such file")
    header: dict[str, Any] = {}
    rows: list[tuple[int, dict[str, Any]]] = []
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or []
            for missing in (compute_col, metric):
                if missing not in columns:
                    raise FitError(f"{path}: column {missing!r} missing; columns are {columns}")
            rows = [(i + 2, row) for i, row in enumerate(reader)]
    else:
        for i, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise FitError(f"{path}:{i}: not JSON ({exc})") from None
            if "run" in record and i == 1:
                header = record["run"]
            else:
                rows.append((i, record))
    compute, R = [], []
    for line, row in rows:
        value = _number(row.get(metric), f"{path}:{line}", metric)
        if value is None:
            continue
        c = _number(row.get(compute_col), f"{path}:{line}", compute_col)
        if c is None:
            raise FitError(f"{path}:{line}: column {compute_col!r} missing on a row that has {metric!r}")
        compute.append(c)
        R.append(value)
    if not compute:
        raise FitError(f"{path}: no rows with {metric!r}")
    order = np.argsort(compute, kind="stable")
    name = label or str(header.get("name") or path.stem)
    return Curve(name, np.asarray(compute)[order], np.asarray(R)[order], str(path), header)
