"""The end of a sweep: the paper's comparison of its runs, written into the sweep directory.

    curves.png     every run's validation points, fitted curve and bootstrap band (scaling/plot.py); runs that could
                   not be fitted as points only
    report.md      per run: status and why it ended, steps, device-hours, A, B, C_mid with their 90% intervals; each
                   run against the leader (the stopping rule's numbers, and the three-way decision at the grid's
                   planned compute, scaling/decision.py's `decide_pair`); the compute the stops saved
    report.json    the same numbers

The compute saved: each stopped run's projected device-hours over its planned steps (its cost per step so far
times `total_steps`) minus what it used, summed, and as a share of the full grid's projected compute (every run
over its planned steps; a finished run counts what it used).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_rl.scaling.compare import Result
from megatron_rl.scaling.decision import decide_pair
from megatron_rl.scaling.sweep import (
    RunState,
    Sweep,
    compute_saved,
    curve_of,
    fit_progress,
    judge,
    leader_of,
    projected_hours,
    read_progress,
)


def _interval(result: Result, name: str) -> list[float] | None:
    return list(result.boot.interval(name)) if result.boot is not None else None


def _cell(value: float, interval: list[float] | None, fmt: str) -> str:
    if interval is None:
        return format(value, fmt)
    return f"{value:{fmt}} [{interval[0]:{fmt}}, {interval[1]:{fmt}}]"


def write_report(sweep: Sweep, directory: Path, runs: dict[str, RunState]) -> list[str]:
    """Write curves.png, report.md and report.json; returns the lines to print."""
    fits: dict[str, Result] = {}
    unfitted: dict[str, str] = {}
    curves = []
    for name in runs:
        metrics = directory / name / "metrics.jsonl"
        progress = read_progress(metrics, sweep.fit.metric)
        fit = fit_progress(name, progress, str(metrics), sweep.fit)
        if isinstance(fit, Result):
            fits[name] = fit
        else:
            unfitted[name] = fit
            if progress.evals:
                curves.append(curve_of(name, progress, str(metrics), sweep.fit.metric))
    leader = leader_of(fits, sweep.stopping.compare)
    target = max((projected_hours(s) for s in runs.values()), default=0.0)
    rows: list[dict[str, Any]] = []
    for name, state in runs.items():
        row: dict[str, Any] = {
            "run": name, "status": state.status, "reason": state.reason, "exit_code": state.exit_code,
            "steps": state.last_step, "total_steps": state.total_steps, "device_hours": state.device_hours,
            "projected_device_hours": projected_hours(state), "evals": state.evals, "stop": state.stop,
        }  # fmt: skip
        if name in fits:
            r = fits[name]
            row["fit"] = {**r.fit.as_dict(), **({} if r.boot is None else r.boot.as_dict())}
        else:
            row["not_fitted"] = unfitted.get(name, "")
        rows.append(row)
    decisions = []
    if leader is not None:
        for name, result in fits.items():
            if name == leader:
                continue
            verdict = judge(fits[leader], result, sweep.stopping)
            entry: dict[str, Any] = {"run": name, "leader": leader, "rule": verdict.describe(), **verdict.__dict__}
            if target > 0:
                at = decide_pair(fits[leader], result, target, sweep.stopping.confidence)
                entry["at_planned_compute"] = at.as_dict()
            decisions.append(entry)
    saved = compute_saved(runs)
    payload = {
        "sweep": str(sweep.path),
        "rule": sweep.stopping.__dict__,
        "leader": leader,
        "planned_compute": target,
        "runs": rows,
        "decisions": decisions,
        "compute_saved": {
            "stopped_used": saved.used,
            "stopped_projected": saved.projected,
            "saved": saved.saved,
            "grid_projected": saved.grid,
            "share": saved.share,
        },  # fmt: skip
    }
    (directory / "report.json").write_text(json.dumps(payload, indent=2, default=str))
    written = [directory / "report.json"]
    if fits or curves:
        from megatron_rl.scaling.plot import plot_results

        written += plot_results(
            list(fits.values()), directory / "curves.png", title=f"sweep {sweep.name}", efficiency=False,
            unfitted=curves,
        )  # fmt: skip
    (directory / "report.md").write_text(_markdown(sweep, payload, fits))
    written.append(directory / "report.md")
    lines = [_summary(payload)]
    lines += [f"  {d['rule']}" for d in decisions]
    lines += [f"  {name}: left out of the comparison, not fitted: {why}" for name, why in unfitted.items()]
    lines += [f"  {s.name}: {s.status}: {s.reason}" for s in runs.values() if s.status in ("crashed", "stalled")]
    lines.append("wrote " + ", ".join(map(str, written)))
    return lines


def _summary(payload: dict[str, Any]) -> str:
    s = payload["compute_saved"]
    counts: dict[str, int] = {}
    for row in payload["runs"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    status = ", ".join(f"{n} {k}" for k, n in counts.items())
    leader = f"leader {payload['leader']}" if payload["leader"] else "no run fitted: no leader"
    return (
        f"sweep done: {status}; {leader}; stopping saved {s['saved']:.4g} of {s['grid_projected']:.4g} device-hours "
        f"({s['share']:.1%} of the full grid's projected compute)"
    )


def _markdown(sweep: Sweep, payload: dict[str, Any], fits: dict[str, Result]) -> str:
    rule = sweep.stopping
    what = "A" if rule.compare == "asymptote" else f"R at {rule.compare:g} device-hours"
    lines = [
        f"# Sweep {sweep.name}",
        "",
        f"Sweep file `{sweep.path}`; stopping rule `{rule.rule}` (compares {what}, confidence {rule.confidence:g}, "
        f"margin {rule.margin:g}, after {rule.min_evals} evaluations and {rule.min_compute:g} device-hours). "
        f"Leader: **{payload['leader'] or 'none'}**. Intervals: 90% bootstrap (residuals resampled as AR(1)).",
        "",
        "| run | status | steps | device-hours | A | B | C_mid | why it ended |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in payload["runs"]:
        name = row["run"]
        if name in fits:
            r = fits[name]
            A = _cell(r.fit.A, _interval(r, "A"), ".3f")
            B = _cell(r.fit.B, _interval(r, "B"), ".2f")
            C = _cell(r.fit.C_mid, _interval(r, "C_mid"), ".3g")
        else:
            A, B, C = f"not fitted: {row['not_fitted']}", "", ""
        lines.append(
            f"| {name} | {row['status']} | {row['steps']}/{row['total_steps']} | {row['device_hours']:.4g} | {A} | "
            f"{B} | {C} | {row['reason']} |"
        )
    warned = [(name, w) for name, r in fits.items() for w in r.fit.warnings]
    if warned:
        lines += ["", "Fit warnings (read those intervals with care):", ""]
        lines += [f"- {name}: {w}" for name, w in warned]
    if payload["decisions"]:
        lines += ["", "## Against the leader", ""]
        for d in payload["decisions"]:
            lines.append(f"- {d['rule']}")
            at = d.get("at_planned_compute")
            if at:
                lines.append(
                    f"  - at the grid's planned compute ({at['target']:.4g} device-hours), {at['verdict']}: "
                    f"{at['text']} (run-to-run margin {at['margin']:g})"
                )
    s = payload["compute_saved"]
    lines += [
        "",
        "## Compute saved by stopping",
        "",
        f"Stopped runs used {s['stopped_used']:.4g} device-hours of the {s['stopped_projected']:.4g} their planned "
        f"steps would have taken: {s['saved']:.4g} saved, {s['share']:.1%} of the full grid's projected "
        f"{s['grid_projected']:.4g} device-hours (a stopped run's projection: its cost per step so far times its "
        "planned steps).",
        "",
        "![curves](curves.png)",
        "",
    ]
    return "\n".join(lines)
