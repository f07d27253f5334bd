"""`megatron-rl sweep SWEEP.yaml`: a grid of training runs, each fitted live, the ones that will lose stopped early.

A sweep file (docs/sweeps.md) names a base recipe, overrides every run shares, and axes whose product is the grid
(or an explicit list of runs). Every run's config is resolved by the config loader before anything starts, so an
unknown field or recipe is refused up front in one line naming the sweep file and its field.

The loop, once per `poll_s`:

    launch the runs still wanted, up to `launcher.parallel` at a time (launchers.py: local processes or sbatch)
    read each run's metrics.jsonl as it grows (a partial last line, re-logged steps and gaps tolerated and named)
    fit each run's validation curve (fit.py + bootstrap.py) once it has `fit.min_points` evaluations
    apply the stopping rule: `halving` stops a run once the leader is ahead of it with the stated confidence
    record why each run ended (finished / stopped by the rule with the numbers / crashed with its exit code /
    stalled: no new metrics for `stall_timeout_s`) in sweep_state.json in the sweep directory

and at the end the paper's comparison (sweep_report.py): the figure, a table of A, B, C_mid with intervals, each
run against the leader, and the compute the stops saved.

**The stopping rule** (`stopping.rule: halving`, in the spirit of successive halving (Jamieson & Talwalkar 2016),
with the fitted curves' intervals instead of a fixed keep-fraction). The leader is the fitted run with the highest
point estimate of the compared quantity: the asymptote A (`stopping.compare: asymptote`, default), or R at a
compute C (`compare: C`). A run other than the leader, with at least `min_evals` evaluations and `min_compute`
device-hours, is stopped when, over the joint bootstrap of the two fits (the i-th refit of one paired with the i-th
of the other: independent runs, scaling/decision.py), the share of draws in which the leader is ahead by more than
`margin` is at least `confidence`. Equivalently the one-sided lower `confidence` bound of leader - run exceeds
`margin`. A run whose asymptote is not identified yet has a wide upper bound, so it is not stopped: the rule errs
towards running on.

**Stopping and signals.** A run is stopped gracefully: SIGTERM to `megatron-rl train` (it checkpoints at the end
of its step and exits, ending what it started; orchestration/stop.py), SIGKILL to its process group after
`stop_grace_s`. The sweep signals
only runs it started: each launch records pid, process group and the process's start time (or the Slurm job id),
and a signal goes out only while the process with that pid still has that start time.

**Resume.** The same command with the same sweep directory reads sweep_state.json: finished, stopped, crashed and
stalled runs are not launched again (`--retry-failed` relaunches crashed and stalled ones), a run still running
from an earlier sweep process is re-attached, one that is gone is launched again (train resumes from its latest
checkpoint). SIGTERM or Ctrl-C to the sweep stops its runs gracefully (they checkpoint) and marks them
interrupted, to be relaunched on resume.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from megatron_rl.config import ConfigError, load_config
from megatron_rl.scaling.compare import Result, fit_run
from megatron_rl.scaling.curves import Curve
from megatron_rl.scaling.decision import MARGIN, decide_pair
from megatron_rl.scaling.fit import FitError

STATE_FILE = "sweep_state.json"
RULES = ("none", "halving")
LAUNCHERS = ("local", "slurm")
TOP_LEVEL = {
    "description", "recipe", "model", "overrides", "axes", "runs", "launcher", "stopping", "fit", "poll_s",
    "stall_timeout_s", "stop_grace_s",
}  # fmt: skip
ENDED = ("finished", "stopped", "crashed", "stalled")
"""Statuses a run keeps across resumes (`--retry-failed` relaunches crashed and stalled runs)."""


class SweepError(ConfigError):
    """The sweep file is wrong: the message names the file and the field."""


# ---------------------------------------------------------------------------------------------------------------
# The sweep file
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunSpec:
    """One run of the grid: its recipe, model and overrides, and where each override came from in the sweep file."""

    name: str
    recipe: str
    model: str | None
    overrides: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    """Axis -> value, for tables and figures."""
    origins: dict[str, str] = field(default_factory=dict)
    """Override key (or `recipe`, `model`) -> the sweep file field that set it, for error messages."""
    total_steps: int = 0
    """The planned steps (the resolved config's total_steps): what a stopped run's projection is made with."""


@dataclass
class Stopping:
    rule: str = "none"
    compare: str | float = "asymptote"
    """`asymptote` (A) or a compute (R at that many device-hours)."""
    confidence: float = 0.9
    margin: float = 0.0
    """asymptote: the difference of A the leader must be ahead by; at a compute: `decide_pair`'s run-to-run margin
    (scaling/decision.py; default there 0.02)."""
    min_evals: int = 5
    """Evaluations after R0 a run (and the leader) needs before the rule judges it."""
    min_compute: float = 0.0
    """Device-hours a run needs before the rule judges it."""


@dataclass
class FitSettings:
    metric: str = "val/pass_rate"
    fit_start: float = 0.0
    bootstrap: int = 200
    min_points: int = 5
    """Evaluations after R0 before a run is fitted (fit.py needs 4)."""


@dataclass
class Sweep:
    path: Path
    name: str
    runs: list[RunSpec]
    launcher: str = "local"
    parallel: int = 1
    slurm: dict[str, Any] = field(default_factory=dict)
    stopping: Stopping = field(default_factory=Stopping)
    fit: FitSettings = field(default_factory=FitSettings)
    poll_s: float = 30.0
    stall_timeout_s: float = 1800.0
    stop_grace_s: float = 600.0


def _fail(path: Path, where: str, message: str) -> SweepError:
    return SweepError(f"{path}: {where}: {message}")


def _overrides(value: Any, path: Path, where: str) -> dict[str, Any]:
    """Overrides as `{dotted.key: value}`, from a mapping (nested or dotted) or a list of `key=value` strings."""
    if value is None:
        return {}
    if isinstance(value, list):
        out = {}
        for i, item in enumerate(value):
            if not isinstance(item, str) or "=" not in item:
                raise _fail(path, f"{where}[{i}]", f"expected 'section.field=value', got {item!r}")
            key, _, text = item.partition("=")
            out[key.strip()] = yaml.safe_load(text) if text else text
        return out
    if isinstance(value, dict):
        return _flatten(value)
    raise _fail(path, where, f"expected a mapping of dotted keys or a list of key=value, got {type(value).__name__}")


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _text(value: Any) -> str:
    """An override's value as the command line takes it (YAML flow: lists, booleans, null)."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _label(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", _text(value))


def expand(data: dict[str, Any], path: Path) -> list[RunSpec]:
    """The runs a sweep file asks for: the product of its axes (first axis varying slowest), then its explicit runs.

    An axis is `recipe` (recipe names), `model` (model configs), a dotted config field (a list of values), or a
    named variant axis: a mapping `label: {overrides}` (e.g. leave-one-out variants of one recipe)."""
    base_recipe = data.get("recipe", "scalerl")
    base_model = data.get("model")
    if not isinstance(base_recipe, str):
        raise _fail(path, "recipe", f"expected a recipe name or path, got {base_recipe!r}")
    common = _overrides(data.get("overrides"), path, "overrides")
    axes = data.get("axes") or {}
    if not isinstance(axes, dict):
        raise _fail(path, "axes", f"expected a mapping of axis -> values, got {type(axes).__name__}")
    choices: list[list[tuple[str, str, dict[str, Any]]]] = []  # per axis: (axis, label, overrides)
    for axis, values in axes.items():
        where = f"axes.{axis}"
        if isinstance(values, dict) and axis not in ("recipe", "model"):
            if not values:
                raise _fail(path, where, "a variant axis needs at least one variant")
            choices.append(
                [(axis, str(label), _overrides(over, path, f"{where}.{label}")) for label, over in values.items()]
            )
        elif isinstance(values, list) and values:
            choices.append([(axis, _label(v), {axis: v}) for v in values])
        else:
            raise _fail(path, where, f"expected a non-empty list of values (or variants), got {values!r}")
    runs: list[RunSpec] = []
    if choices:
        for combo in itertools.product(*choices):
            recipe, model, over, origins, labels = base_recipe, base_model, dict(common), {}, {}
            origins.update({k: f"overrides.{k}" for k in common})
            for axis, label, values in combo:
                labels[axis] = label
                for key, value in values.items():
                    if key == "recipe":
                        recipe = str(value)
                    elif key == "model":
                        model = str(value)
                    else:
                        over[key] = value
                    origins[key] = f"axes.{axis}" + ("" if key == axis else f".{label}")
            name = "_".join(f"{axis.rsplit('.', 1)[-1]}-{label}" for axis, label, _ in combo)
            runs.append(_spec(name, recipe, model, over, labels, origins))
    explicit = data.get("runs") or []
    if not isinstance(explicit, list):
        raise _fail(path, "runs", f"expected a list of runs, got {type(explicit).__name__}")
    for i, entry in enumerate(explicit):
        where = f"runs[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise _fail(path, where, "each run is a mapping with a name (and recipe, model, overrides)")
        unknown = sorted(set(entry) - {"name", "recipe", "model", "overrides"})
        if unknown:
            raise _fail(path, f"{where}.{unknown[0]}", "unknown key; a run has name, recipe, model, overrides")
        over = dict(common)
        own = _overrides(entry.get("overrides"), path, f"{where}.overrides")
        over.update(own)
        origins = {k: f"overrides.{k}" for k in common} | {k: f"{where}.overrides.{k}" for k in own}
        origins.update(recipe=f"{where}.recipe", model=f"{where}.model")
        runs.append(
            _spec(entry["name"], entry.get("recipe", base_recipe), entry.get("model", base_model), over, {}, origins)
        )
    if not runs:
        raise _fail(path, "axes", "the sweep has no runs: give axes or runs")
    names = [r.name for r in runs]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise _fail(path, "runs", f"run names must differ; {doubled} appear more than once")
    return runs


def _spec(
    name: str, recipe: str, model: Any, over: dict[str, Any], labels: dict[str, str], origins: dict[str, str]
) -> RunSpec:
    origins.setdefault("recipe", "recipe")
    origins.setdefault("model", "model")
    overrides = [f"{key}={_text(value)}" for key, value in over.items()]
    return RunSpec(name, recipe, None if model is None else str(model), overrides, labels, origins)


FORBIDDEN = ("name", "output_dir")
"""Set by the sweep for every run (its directory under the sweep directory)."""


def validate(runs: list[RunSpec], path: Path) -> None:
    """Resolve every run's config as `megatron-rl train` would, before anything is launched; the first refusal is
    raised naming the sweep file, the field that set it and the run."""
    for run in runs:
        for key in FORBIDDEN:
            if any(o.split("=", 1)[0] == key for o in run.overrides):
                raise _fail(path, run.origins.get(key, key), f"{key} is set by the sweep for each run; remove it")
        try:
            config = load_config(run.recipe, run.model, [*run.overrides, f"name={run.name}"])
        except ConfigError as exc:
            message = str(exc)
            field_name = message.split(":", 1)[0].strip()
            where = _origin(run, field_name, message)
            raise _fail(path, where, f"{message} (run {run.name})") from None
        run.total_steps = config.total_steps


def _origin(run: RunSpec, field_name: str, message: str) -> str:
    """The sweep field behind a config error: the override whose key the error names (or a parent or child of it),
    the recipe or model for an unknown one, else the run."""
    if message.startswith("recipe:"):
        return run.origins["recipe"]
    if message.startswith("model:"):
        return run.origins["model"]
    for key, origin in run.origins.items():
        if field_name == key or field_name.startswith(key + ".") or key.startswith(field_name + "."):
            return origin
    return f"run {run.name}"


def _number(data: dict[str, Any], key: str, default: float, path: Path, where: str, low: float = 0.0) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low:
        raise _fail(path, f"{where}{key}", f"expected a number >= {low:g}, got {value!r}")
    return float(value)


def _section(data: dict[str, Any], key: str, known: set[str], path: Path) -> dict[str, Any]:
    section = data.get(key) or {}
    if not isinstance(section, dict):
        raise _fail(path, key, f"expected a mapping, got {type(section).__name__}")
    unknown = sorted(set(section) - known)
    if unknown:
        raise _fail(path, f"{key}.{unknown[0]}", f"unknown key; known: {sorted(known)}")
    return section


def load_sweep(path: str | Path) -> Sweep:
    """Read, expand and validate a sweep file (every run's config resolved)."""
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"{path}: no such sweep file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SweepError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a mapping at the top level")
    unknown = sorted(set(data) - TOP_LEVEL)
    if unknown:
        raise _fail(path, unknown[0], f"unknown key; a sweep file has {sorted(TOP_LEVEL)}")
    runs = expand(data, path)
    launch = _section(data, "launcher", {"kind", "parallel", "script", "sbatch_args"}, path)
    kind = launch.get("kind", "local")
    if kind not in LAUNCHERS:
        raise _fail(path, "launcher.kind", f"{kind!r} is not one of {list(LAUNCHERS)}")
    parallel = int(_number(launch, "parallel", 1, path, "launcher.", low=1))
    slurm: dict[str, Any] = {k: launch[k] for k in ("script", "sbatch_args") if k in launch}
    if not isinstance(slurm.get("sbatch_args", []), list):
        raise _fail(path, "launcher.sbatch_args", f"expected a list of sbatch options, got {slurm['sbatch_args']!r}")
    if not isinstance(slurm.get("script", ""), str):
        raise _fail(path, "launcher.script", f"expected a path to a batch script, got {slurm['script']!r}")
    if kind == "slurm":
        for run in runs:  # slurm/bootstrap.sh splits OVERRIDES on spaces
            spaced = [o for o in run.overrides if " " in o]
            if spaced:
                raise _fail(path, run.origins.get(spaced[0].split("=")[0], "overrides"), "a value with a space "
                            f"cannot pass through slurm/bootstrap.sh's OVERRIDES: {spaced[0]!r}")  # fmt: skip
    stop = _section(data, "stopping", {"rule", "compare", "confidence", "margin", "min_evals", "min_compute"}, path)
    rule = stop.get("rule", "none")
    if rule not in RULES:
        raise _fail(path, "stopping.rule", f"{rule!r} is not one of {list(RULES)}")
    compare = stop.get("compare", "asymptote")
    if compare != "asymptote" and (isinstance(compare, bool) or not isinstance(compare, (int, float)) or compare <= 0):
        raise _fail(path, "stopping.compare", f"expected 'asymptote' or a compute > 0, got {compare!r}")
    confidence = _number(stop, "confidence", 0.9, path, "stopping.")
    if not 0 < confidence < 1:
        raise _fail(path, "stopping.confidence", f"must be in (0, 1), got {confidence}")
    stopping = Stopping(
        rule, compare if compare == "asymptote" else float(compare), confidence,
        _number(stop, "margin", 0.0 if compare == "asymptote" else MARGIN, path, "stopping.",
                low=-1.0 if compare == "asymptote" else 0.0),
        int(_number(stop, "min_evals", 5, path, "stopping.", low=4)),
        _number(stop, "min_compute", 0.0, path, "stopping."),
    )  # fmt: skip
    fit_data = _section(data, "fit", {"metric", "fit_start", "bootstrap", "min_points"}, path)
    fit = FitSettings(
        str(fit_data.get("metric", "val/pass_rate")),
        _number(fit_data, "fit_start", 0.0, path, "fit."),
        int(_number(fit_data, "bootstrap", 200, path, "fit.", low=20)),
        int(_number(fit_data, "min_points", 5, path, "fit.", low=4)),
    )
    validate(runs, path)
    return Sweep(
        path, path.stem, runs, kind, parallel, slurm, stopping, fit,
        _number(data, "poll_s", 30.0, path, "", low=0.1),
        _number(data, "stall_timeout_s", 1800.0, path, "", low=1.0),
        _number(data, "stop_grace_s", 600.0, path, "", low=1.0),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# A run's metrics as they grow
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Progress:
    """What a run's metrics.jsonl holds so far."""

    last_step: int = 0
    device_hours: float = 0.0
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    """(step, device-hours, metric) of each evaluation, in step order; a re-logged step keeps its last row."""
    relogged: int = 0
    """Rows of a step logged before by a start that was cut short (a resumed run logs the steps after its
    checkpoint again); the final evaluation's second row of the last step is not one."""
    gaps: list[tuple[int, int]] = field(default_factory=list)
    """Missing step ranges (first, last) between logged steps."""
    bad_lines: list[str] = field(default_factory=list)
    """`file:line: why` of each line that could not be read (left out, counted)."""
    size: int = 0
    """Bytes read: a run whose file stops growing is stalled."""


def read_progress(path: Path, metric: str = "val/pass_rate") -> Progress:
    """The run's metrics so far. A partial last line (the run is writing it) is left for the next read, not counted;
    any other unreadable line is named in `bad_lines` and left out."""
    progress = Progress()
    if not path.is_file():
        return progress
    text = path.read_text()
    progress.size = len(text)
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # being written
    rows: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            progress.bad_lines.append(f"{path}:{number}: not JSON ({exc.msg})")
            continue
        if not isinstance(record, dict) or "run" in record:
            continue
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            if "config_change" not in record:
                progress.bad_lines.append(f"{path}:{number}: no step")
            continue
        step = int(step)
        if step in rows:
            # The final evaluation is a second row of the last step (merged); a step logged again after a lower one,
            # or a second step row of one step, is a resumed run re-logging the steps after its checkpoint.
            progress.relogged += step < max(rows) or ("time/step_s" in record and "time/step_s" in rows[step])
            rows[step] = {**rows[step], **record}  # the last value of each column wins
        else:
            rows[step] = record
    steps = sorted(rows)
    for a, b in itertools.pairwise(steps):
        if b > a + 1:
            progress.gaps.append((a + 1, b - 1))
    for step in steps:
        row = rows[step]
        hours, value = row.get("device_hours"), row.get(metric)
        if isinstance(hours, (int, float)) and not isinstance(hours, bool) and math.isfinite(hours):
            progress.device_hours = max(progress.device_hours, float(hours))
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                progress.evals.append((step, float(hours), float(value)))
    progress.last_step = steps[-1] if steps else 0
    return progress


def curve_of(name: str, progress: Progress, source: str, metric: str) -> Curve:
    steps = np.array([s for s, _, _ in progress.evals], dtype=np.float64)
    compute = np.array([c for _, c, _ in progress.evals])
    R = np.array([r for _, _, r in progress.evals])
    return Curve(name, compute, R, source, metric, {}, steps)


def fit_progress(name: str, progress: Progress, source: str, settings: FitSettings, seed: int = 0) -> Result | str:
    """The run's fit with bootstrap refits, or why there is none yet."""
    usable = len(progress.evals) - 1  # the first evaluation is R0
    if usable < settings.min_points:
        return f"{max(usable, 0)} of {settings.min_points} evaluations after R0"
    curve = curve_of(name, progress, source, settings.metric)
    try:
        return fit_run(curve, fit_start=settings.fit_start, n_boot=settings.bootstrap, level=0.9, seed=seed)
    except FitError as exc:
        return str(exc)


# ---------------------------------------------------------------------------------------------------------------
# The stopping rule
# ---------------------------------------------------------------------------------------------------------------


def quantity(result: Result, compare: str | float) -> tuple[float, np.ndarray]:
    """The compared quantity's point estimate and its bootstrap draws: A, or R at a compute."""
    assert result.boot is not None, "fit_progress always bootstraps"
    if compare == "asymptote":
        return result.fit.A, result.boot.samples[:, 0]
    at = float(compare)
    return float(result.fit.predict([at])[0]), result.boot.curves([at])[:, 0]


@dataclass
class Verdict:
    """The rule's judgement of one run against the leader."""

    run: str
    leader: str
    stop: bool
    leader_value: float
    run_value: float
    diff_lo: float
    """The one-sided lower `confidence` bound of leader - run."""
    p_ahead: float
    """Share of joint draws in which the leader is ahead by more than the margin."""
    compare: str | float
    confidence: float
    margin: float
    decision: str = ""
    """At a compute: `decide_pair`'s verdict, as text (winner / undecided / crossover)."""

    def describe(self) -> str:
        what = "A" if self.compare == "asymptote" else f"R@{self.compare:g}"
        verb = "stop" if self.stop else "keep"
        if self.decision:
            return f"{verb} {self.run}: {self.decision}"
        return (
            f"{verb} {self.run}: leader {self.leader} {what} {self.leader_value:.3f} vs {self.run_value:.3f}, "
            f"lower {self.confidence:.0%} bound of the difference {self.diff_lo:+.3f} "
            f"{'>' if self.stop else '<='} margin {self.margin:+.3f} (P(leader ahead by > margin) {self.p_ahead:.2f})"
        )


def judge(leader: Result, run: Result, stopping: Stopping) -> Verdict:
    """Whether `run` is behind `leader` with the stated confidence (module docstring). The i-th refit of one is
    paired with the i-th of the other: the runs are independent, so the pairs are draws of the difference. At a
    compute, the decision is scaling/decision.py's `decide_pair` there: stop when it names the leader (winner, or
    ahead at the compute after a crossover)."""
    if stopping.compare != "asymptote":
        d = decide_pair(leader, run, float(stopping.compare), stopping.confidence, stopping.margin)
        R_lead, R_run = (float(r.fit.predict([d.target])[0]) for r in (leader, run))
        return Verdict(
            run.curve.label, leader.curve.label, d.leader == leader.curve.label, R_lead, R_run, d.interval[0],
            d.p_a_ahead, stopping.compare, stopping.confidence, stopping.margin, d.describe(),
        )  # fmt: skip
    lead_value, lead_draws = quantity(leader, stopping.compare)
    run_value, run_draws = quantity(run, stopping.compare)
    n = min(lead_draws.size, run_draws.size)
    diff = lead_draws[:n] - run_draws[:n]
    lo = float(np.quantile(diff, 1 - stopping.confidence))
    p = float(np.mean(diff > stopping.margin))
    stop = lo > stopping.margin
    return Verdict(
        run.curve.label, leader.curve.label, stop, lead_value, run_value, lo, p, stopping.compare,
        stopping.confidence, stopping.margin,
    )  # fmt: skip


def leader_of(fits: dict[str, Result], compare: str | float) -> str | None:
    if not fits:
        return None
    return max(fits, key=lambda name: quantity(fits[name], compare)[0])


def rule_verdicts(
    fits: dict[str, Result],
    progress: dict[str, Progress],
    candidates: list[str],
    stopping: Stopping,
    problems: list[str] | None = None,
) -> list[Verdict]:
    """The rule over the fitted runs: a verdict for each candidate (a running run) that is judged now. A pair the
    decision cannot be made for is left unjudged, the reason appended to `problems`."""
    if stopping.rule == "none":
        return []
    eligible = {n: r for n, r in fits.items() if len(progress[n].evals) - 1 >= stopping.min_evals}
    leader = leader_of(eligible, stopping.compare)
    if leader is None:
        return []
    verdicts = []
    for name in candidates:
        if name == leader or name not in eligible or progress[name].device_hours < stopping.min_compute:
            continue
        try:
            verdicts.append(judge(eligible[leader], eligible[name], stopping))
        except FitError as exc:
            if problems is not None:
                problems.append(f"{name}: not judged against {leader}: {exc}")
    return verdicts


# ---------------------------------------------------------------------------------------------------------------
# State: what the sweep started and how each run ended
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RunState:
    name: str
    overrides: list[str]
    recipe: str
    model: str | None
    total_steps: int
    status: str = "pending"
    """pending / running / finished / stopped / crashed / stalled / interrupted."""
    pid: int | None = None
    pgid: int | None = None
    start_time: int | None = None
    """The process's start time (clock ticks since boot, /proc/PID/stat): a pid reused by another process differs."""
    job_id: str | None = None
    launches: int = 0
    exit_code: int | None = None
    reason: str = ""
    stop: dict[str, Any] | None = None
    """The rule's numbers when it stopped the run (or why the sweep stopped it), set when the stop is sent."""
    last_step: int = 0
    device_hours: float = 0.0
    evals: int = 0


def new_state(sweep: Sweep) -> dict[str, RunState]:
    return {r.name: RunState(r.name, r.overrides, r.recipe, r.model, r.total_steps) for r in sweep.runs}


def save_state(directory: Path, sweep: Sweep, runs: dict[str, RunState]) -> None:
    data = {"sweep": str(sweep.path), "runs": {name: asdict(state) for name, state in runs.items()}}
    tmp = directory / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, directory / STATE_FILE)  # a sweep killed mid-write leaves the previous state whole


def load_state(directory: Path, sweep: Sweep) -> dict[str, RunState]:
    """The state an earlier sweep process left, matched against this sweep file's runs: a run the file no longer has
    is refused, as is one whose overrides changed (its checkpoints belong to the other experiment)."""
    path = directory / STATE_FILE
    if not path.is_file():
        return new_state(sweep)
    try:
        data = json.loads(path.read_text())
        saved = {name: RunState(**entry) for name, entry in data["runs"].items()}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SweepError(f"{path}: not a sweep state file ({exc}); move it away to start the sweep afresh") from None
    fresh = new_state(sweep)
    for name, state in saved.items():
        if name not in fresh:
            raise SweepError(f"{path}: run {name} is not in {sweep.path} any more; use another sweep directory")
        if (state.overrides, state.recipe, state.model) != (
            fresh[name].overrides,
            fresh[name].recipe,
            fresh[name].model,
        ):
            raise SweepError(
                f"{path}: run {name} was launched with recipe {state.recipe}, overrides {state.overrides}; "
                f"{sweep.path} now gives {fresh[name].recipe}, {fresh[name].overrides}: use another sweep directory"
            )
        fresh[name] = state
    return fresh


def resume_action(state: RunState, alive: bool, retry_failed: bool = False) -> str:
    """What a (re)started sweep does with a run: `skip` (it ended), `attach` (its process from an earlier sweep
    process is still running), or `launch` (not started, interrupted, or gone: train resumes from its checkpoint)."""
    if state.status in ("finished", "stopped"):
        return "skip"
    if state.status in ("crashed", "stalled"):
        return "launch" if retry_failed else "skip"
    if state.status == "running" and alive:
        return "attach"
    return "launch"


def outcome(state: RunState, exit_code: int | None, progress: Progress) -> tuple[str, str]:
    """(status, reason) of a run whose process ended. `exit_code` None: the process was not this sweep process's
    child (re-attached), so the metrics tell whether it finished."""
    done = progress.last_step >= state.total_steps
    if state.stop is not None and done and exit_code in (0, None):
        return "finished", f"{progress.last_step} of {state.total_steps} steps (it ended before the stop took effect)"
    if state.stop is not None:
        why = state.stop.get("why", "stopped")
        if state.stop.get("kind") == "stall":
            return "stalled", why
        if state.stop.get("kind") == "interrupt":
            return "interrupted", why
        code = "" if exit_code is None else f", exit code {exit_code}"
        return "stopped", f"{why} (at step {progress.last_step} of {state.total_steps}{code})"
    if exit_code == 0 and done or exit_code is None and done:
        return "finished", f"{progress.last_step} of {state.total_steps} steps"
    if exit_code is None:
        return "crashed", (
            f"ended at step {progress.last_step} of {state.total_steps}; exit code unknown (started by an earlier "
            "sweep process)"
        )
    if exit_code == 0:
        return "interrupted", f"exited 0 at step {progress.last_step} of {state.total_steps} (stopped from outside)"
    return "crashed", f"exit code {exit_code} at step {progress.last_step} of {state.total_steps}"


# ---------------------------------------------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------------------------------------------


def projected_hours(state: RunState) -> float:
    """A run's device-hours over its planned steps: what it used where it reached them, else its cost per step so
    far times its planned steps."""
    if state.last_step <= 0:
        return state.device_hours
    if state.last_step >= state.total_steps:
        return state.device_hours
    return state.device_hours / state.last_step * state.total_steps


@dataclass
class Saved:
    used: float
    """Device-hours the stopped runs used."""
    projected: float
    """Device-hours the stopped runs would have used over their planned steps."""
    grid: float
    """Device-hours of the full grid: every run over its planned steps (finished: what it used)."""

    @property
    def saved(self) -> float:
        return self.projected - self.used

    @property
    def share(self) -> float:
        return self.saved / self.grid if self.grid > 0 else 0.0


def compute_saved(runs: dict[str, RunState]) -> Saved:
    stopped = [s for s in runs.values() if s.status == "stopped"]
    return Saved(
        sum(s.device_hours for s in stopped),
        sum(projected_hours(s) for s in stopped),
        sum(projected_hours(s) for s in runs.values()),
    )


# ---------------------------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------------------------


class Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _say(line: str) -> None:
    print(f"[sweep {time.strftime('%H:%M:%S')}] {line}", flush=True)


def run_sweep(
    sweep: Sweep, directory: Path, launcher: Any, retry_failed: bool = False, say: Callable[[str], None] = _say
) -> dict[str, RunState]:
    """Launch, watch, fit and stop the sweep's runs until each has ended; returns their states (also in the state
    file). `launcher` is launchers.py's LocalLauncher or SlurmLauncher."""
    directory.mkdir(parents=True, exist_ok=True)
    runs = load_state(directory, sweep)
    specs = {r.name: r for r in sweep.runs}
    wanted: list[str] = []
    for name, state in runs.items():
        action = resume_action(state, state.status == "running" and launcher.alive(state), retry_failed)
        if action == "skip":
            say(f"{name}: {state.status} earlier ({state.reason}); not launched again")
            continue
        if action == "attach":
            say(f"{name}: still running from an earlier sweep process ({launcher.describe(state)}): re-attached")
            launcher.attach(state)
        else:
            if state.status in ("running", "crashed", "stalled", "interrupted"):
                say(f"{name}: {state.status} earlier; launched again (train resumes from its latest checkpoint)")
            state.status, state.stop, state.exit_code = "pending", None, None
        wanted.append(name)
    save_state(directory, sweep, runs)
    handlers = _catch_signals()
    fits: dict[str, Result] = {}
    fitted_at: dict[str, int] = {}
    last_growth: dict[str, float] = {}
    sizes: dict[str, int] = {}
    named: dict[str, set[str]] = {}
    signalled: dict[str, float] = {}
    try:
        while True:
            active = [n for n in wanted if runs[n].status == "running"]
            pending = [n for n in wanted if runs[n].status == "pending"]
            for name in pending[: max(0, sweep.parallel - len(active))]:
                state = runs[name]
                try:
                    launcher.launch(specs[name], state, directory)
                except (RuntimeError, OSError) as exc:  # sbatch refused it, the command could not start
                    state.status, state.reason = "crashed", f"not launched: {' '.join(str(exc).split())}"
                    say(f"{name}: {state.reason}")
                    continue
                state.status, state.launches = "running", state.launches + 1
                last_growth[name] = time.monotonic()
                say(f"{name}: launched ({launcher.describe(state)}), log {launcher.log(state, directory)}")
            now = time.monotonic()
            progress: dict[str, Progress] = {}
            for name, state in runs.items():
                metrics = directory / name / "metrics.jsonl"
                p = progress[name] = read_progress(metrics, sweep.fit.metric)
                state.last_step, state.device_hours, state.evals = p.last_step, p.device_hours, len(p.evals)
                for note in _notes(p):
                    if note not in named.setdefault(name, set()):
                        named[name].add(note)
                        say(f"{name}: {note}")
                if p.size != sizes.get(name):
                    sizes[name], last_growth[name] = p.size, now
                points = hash(tuple(p.evals))  # a new evaluation, or a value replaced (the final evaluation's row)
                if points != fitted_at.get(name):
                    fitted_at[name] = points
                    fit = fit_progress(name, p, str(metrics), sweep.fit)
                    if isinstance(fit, Result):
                        fits[name] = fit
                    else:
                        fits.pop(name, None)
            for name in [n for n in wanted if runs[n].status == "running"]:
                state = runs[name]
                code = launcher.poll(state)
                if code is not False:
                    state.exit_code = None if code is None else int(code)
                    state.status, state.reason = outcome(state, state.exit_code, progress[name])
                    say(f"{name}: {state.status}: {state.reason}")
                    continue
                if state.stop is None and now - last_growth.get(name, now) > sweep.stall_timeout_s:
                    why = f"stalled: no new metrics for {now - last_growth[name]:.0f} s (stall_timeout_s)"
                    state.stop = {"kind": "stall", "why": why}
                    say(f"{name}: {why}; stopping it")
                if state.stop is not None and name not in signalled:
                    signalled[name] = now
                    launcher.stop(state)
                elif state.stop is not None and now - signalled[name] > sweep.stop_grace_s:
                    say(f"{name}: still running {sweep.stop_grace_s:.0f} s after SIGTERM: killed")
                    launcher.stop(state, kill=True)
                    signalled[name] = math.inf
            running = [n for n in wanted if runs[n].status == "running" and runs[n].stop is None]
            problems: list[str] = []
            verdicts = rule_verdicts(fits, progress, running, sweep.stopping, problems)
            for problem in problems:
                say(problem)
            for verdict in verdicts:
                if verdict.stop:
                    state = runs[verdict.run]
                    state.stop = {"kind": "rule", "why": verdict.describe(), **asdict(verdict)}
                    signalled[verdict.run] = time.monotonic()
                    say(f"{verdict.run}: {verdict.describe()}")
                    launcher.stop(state)
            save_state(directory, sweep, runs)
            say(_poll_line(runs, fits, list(runs)))
            if all(runs[n].status not in ("pending", "running") for n in wanted):
                return runs
            time.sleep(sweep.poll_s)
    except Interrupted as exc:
        say(f"{exc}: stopping the runs this sweep started (each checkpoints); resume with the same command")
        _interrupt(runs, launcher, sweep, say)
        save_state(directory, sweep, runs)
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _catch_signals() -> dict[int, Any]:
    def interrupted(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    return {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGINT)}


def _interrupt(runs: dict[str, RunState], launcher: Any, sweep: Sweep, say: Callable[[str], None]) -> None:
    """The sweep was asked to stop: SIGTERM to each running run, wait for them (SIGKILL after the grace)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not leave runs half-stopped
    live = [s for s in runs.values() if s.status == "running"]
    for state in live:
        state.stop = state.stop or {"kind": "interrupt", "why": "the sweep was interrupted"}
        launcher.stop(state)
    deadline = time.monotonic() + sweep.stop_grace_s
    while live and time.monotonic() < deadline:
        time.sleep(1.0)
        for state in list(live):
            code = launcher.poll(state)
            if code is not False:
                state.exit_code = code
                progress = Progress(last_step=state.last_step, device_hours=state.device_hours)
                state.status, state.reason = outcome(state, code, progress)
                live.remove(state)
    for state in live:
        launcher.stop(state, kill=True)
        state.status, state.reason = "interrupted", "the sweep was interrupted; killed after the grace"
    say(f"{len(runs)} runs: " + ", ".join(f"{s.name} {s.status}" for s in runs.values()))


def _notes(p: Progress) -> list[str]:
    notes = list(p.bad_lines)
    if p.relogged:
        notes.append(f"{p.relogged} re-logged steps (a resumed run): the last row of each step is used")
    notes += [f"steps {a}-{b} missing from metrics.jsonl" if b > a else f"step {a} missing" for a, b in p.gaps]
    return notes


def _poll_line(runs: dict[str, RunState], fits: dict[str, Result], wanted: list[str]) -> str:
    parts = []
    for name in wanted:
        s = runs[name]
        text = f"{name} {s.status} {s.last_step}/{s.total_steps} {s.device_hours:.3g}h"
        boot = fits[name].boot if name in fits else None
        if boot is not None:
            lo, hi = boot.interval("A")
            text += f" A={fits[name].fit.A:.3f} [{lo:.3f}, {hi:.3f}]"
        parts.append(text)
    return "; ".join(parts)
