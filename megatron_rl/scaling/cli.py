"""`megatron-rl fit`: fit, predict and compare sigmoidal compute-performance curves from training runs.

megatron-rl fit runs/*/metrics.jsonl --fit-start 1500 --predict-at 100000 --plot out.png
megatron-rl fit a.jsonl b.jsonl --compare                  recipes: the paper's shared-A rule, then B
megatron-rl fit a=a1.jsonl a=a2.jsonl b=b1.jsonl b=b2.jsonl --compare   repeated runs: one curve per label
megatron-rl fit run.jsonl --extrapolate-from 50000         fit up to 50k, predict the rest (or: half)
megatron-rl fit 512=b512.jsonl 2048=b2048.jsonl --axis batch       label runs on the command line
megatron-rl fit runs/*/metrics.jsonl --axis rollout.generations_per_prompt   label from header/config.yaml
megatron-rl fit run.jsonl --metric 'val/pass_rate/*'       one curve per task
megatron-rl fit run.jsonl --metric val/pass_rate,downstream/aime24/mean@16   validation beside AIME-24
megatron-rl fit export.csv --compute-col gpu_hours --metric val/pass_rate   a wandb CSV export

Warm-up cut: --fit-start, else the paper's 1,500 when the compute column is GPU-hours (device_hours,
gpu_hours) and the fitted range reaches beyond 3,000, else none. Every run prints one line naming the
choices that differ from the paper's procedure (fit start, --method fast vs its grid, R0), also under
"differs_from_paper" in --json (whose "fit_start" is null under the default; each curve's is in its entry).

Intervals: residual bootstrap; by default the residuals are resampled as an AR(1) series, since the
validation points of one run are autocorrelated. They cover the evaluation noise within one run; the
run-to-run variation of a recipe (the paper's +/-0.02 on A) is in them only when repeated runs are given
under one label (label=path for each file, or the same --axis value): their points are fitted as one
curve and the bootstrap resamples the runs as well.

Decisions between two or more runs (scaling/decision.py), per pair at each --predict-at (else the end of the
crossover range): winner, undecided, or crossover (each run ahead at --level on its side of C*), with a
run-to-run term from --margin (two single runs of one recipe within --margin of each other 90% of the
time; paper: 0.02), divided by sqrt(k) for a label that pools k runs.

Exit status: 0 every curve fitted; 1 some could not be (each named on stderr and under "failed" in --json;
the others are fitted, printed and plotted, the unfitted ones plotted as points); 2 none fitted or bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from megatron_rl.scaling.bootstrap import METHODS as BOOTSTRAP_METHODS
from megatron_rl.scaling.compare import (
    Result,
    extrapolation_table,
    fit_run,
    shared_asymptote,
    shared_table,
    table,
)
from megatron_rl.scaling.curves import Curve, label_for, load_curves, pool_runs, sort_key
from megatron_rl.scaling.decision import (
    Crossover,
    Decision,
    Difference,
    crossovers,
    decide,
    decide_pairs,
    decision_table,
)
from megatron_rl.scaling.fit import METHODS, PAPER_A_GRID, PAPER_C_MID_GRID, FitError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatron-rl fit",
        description="Fit R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) to training curves (docs/recipe.md §1).",
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="metrics JSONL or CSV (or a run directory), or label=path")
    p.add_argument(
        "--fit-start",
        type=float,
        default=None,
        help="warm-up cut in compute units (paper: 1500 GPU-hours). Default: 1500 when the compute column is "
        "GPU-hours (device_hours, gpu_hours) and the fitted range reaches beyond 3000, else 0",
    )
    p.add_argument("--predict-at", type=float, nargs="+", default=[], metavar="C", help="predict R here (+ interval)")
    p.add_argument("--plot", default=None, metavar="OUT", help="write the figure (.png; .svg also writes a .png)")
    p.add_argument("--title", default=None, help="plot title")
    p.add_argument("--no-efficiency", action="store_true", help="plot without the efficiency panel")
    p.add_argument("--method", choices=METHODS, default="fast", help="fast (default) or the paper's grid")
    p.add_argument("--bootstrap", type=int, default=1000, metavar="N", help="bootstrap refits (0: no intervals)")
    p.add_argument(
        "--bootstrap-method",
        choices=BOOTSTRAP_METHODS,
        default="ar",
        help="residual resampling: ar (default; autocorrelated evaluation noise), block, or iid",
    )
    p.add_argument("--level", type=float, default=0.9, help="interval coverage (default 0.9)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--compute-col", default="device_hours", help="compute column (default device_hours)")
    p.add_argument("--compute-scale", type=float, default=1.0, help="multiply the compute column by this")
    p.add_argument(
        "--metric",
        default="val/pass_rate",
        help="performance column; 'val/pass_rate/*': one per task; 'downstream/*/mean@16': one per benchmark; "
        "comma-separated columns are fitted and plotted side by side",
    )
    p.add_argument("--step-col", default="step", help="step column (duplicate steps: the last row wins)")
    p.add_argument("--r0", type=float, default=None, help="R0 (default: the first evaluation of each run)")
    p.add_argument("--compare", action="store_true", help="the paper's rule: shared A within --margin, compare B")
    p.add_argument(
        "--margin",
        type=float,
        default=0.02,
        help="run-to-run margin (paper: 0.02): --compare treats A's closer than this as the same; the decision "
        "between runs models two single runs of one recipe as differing by less than this 90%% of the time",
    )
    p.add_argument(
        "--extrapolate-from", default=None, metavar="C|half", help="fit up to compute C (or half of each run)"
    )
    p.add_argument("--axis", default=None, metavar="KEY", help="scaling axis: label runs by this header/config key")
    p.add_argument(
        "--crossover-range",
        type=float,
        nargs=2,
        metavar=("C1", "C2"),
        help="where to look for crossovers of two or more curves (default: the first evaluation to the largest "
        "--predict-at or last evaluation)",
    )
    p.add_argument("--json", default=None, metavar="OUT", help="write every number printed as JSON here")
    return p


def _resolve_run(spec: str) -> tuple[str | None, Path]:
    label, sep, rest = spec.partition("=")
    path = Path(spec)
    if sep and not path.exists():
        path = Path(rest)
    else:
        label = ""
    if path.is_dir():
        path = path / "metrics.jsonl"
    return label or None, path


def _load(args: argparse.Namespace) -> list[Curve]:
    """The curves to fit, one per label: runs given one label on the command line (label=path) or by --axis
    are repeated runs of one recipe, pooled into one curve; runs whose names merely coincide are an error."""
    groups: dict[str, list[Curve]] = {}
    named: set[str] = set()
    metrics = _metrics(args)
    for spec in args.runs:
        label, path = _resolve_run(spec)
        loaded = []
        for metric in metrics:
            curves = load_curves(path, args.compute_col, metric, label, args.step_col, args.compute_scale)
            if len(metrics) > 1:  # several metrics of one run side by side: each curve named by its metric
                for curve in curves:
                    curve.label = f"{curve.label} {metric}" if len(curves) == 1 else curve.label
            loaded += curves
        if args.axis and label is None:
            for curve in loaded:
                value = label_for(curve, args.axis)
                curve.label = value if len(loaded) == 1 else f"{value} {curve.label.rsplit(' ', 1)[-1]}"
        if label is not None or args.axis:
            named.update(c.label for c in loaded)
        for curve in loaded:
            groups.setdefault(curve.label, []).append(curve)
    duplicated = sorted(label for label, group in groups.items() if len(group) > 1 and label not in named)
    if duplicated:
        raise FitError(
            f"runs share the labels {duplicated}: name them on the command line (label=path; "
            "one label for several files fits them as repeated runs of one recipe)"
        )
    curves = [pool_runs(group) for group in groups.values()]
    if args.axis:
        curves.sort(key=lambda c: sort_key(c.label))
    return curves


def _metrics(args: argparse.Namespace) -> list[str]:
    """--metric's comma-separated columns (validation and downstream side by side)."""
    return [m.strip() for m in args.metric.split(",") if m.strip()]


PAPER_FIT_START = 1500.0
"""The paper's warm-up cut, in GPU-hours (about one epoch)."""
GPU_HOURS = ("device_hours", "gpu_hours")
"""Compute columns in GPU-hours, the unit of the paper's cut."""


def _in_gpu_hours(args: argparse.Namespace) -> bool:
    return args.compute_col in GPU_HOURS and args.compute_scale == 1


def _fit_start(curve: Curve, cut: float | None, args: argparse.Namespace) -> float:
    """--fit-start when given; else the paper's 1,500 GPU-hours when the compute is in GPU-hours and the
    fitted range reaches beyond twice that (a shorter curve would keep too little after the cut), else 0."""
    if args.fit_start is not None:
        return args.fit_start
    end = float(curve.compute.max()) if cut is None else min(cut, float(curve.compute.max()))
    return PAPER_FIT_START if _in_gpu_hours(args) and end > 2 * PAPER_FIT_START else 0.0


def paper_differences(args: argparse.Namespace, results: list[Result]) -> list[str]:
    """The choices of this fit that differ from the paper's procedure (docs/recipe.md §1)."""
    out = []
    if not _in_gpu_hours(args):
        scale = f" x {args.compute_scale:g}" if args.compute_scale != 1 else ""
        out.append(f"compute column {args.compute_col!r}{scale} (paper: GPU-hours)")
    off = [r.curve.label for r in results if r.fit.fit_start != PAPER_FIT_START]
    if off and args.fit_start is not None:
        out.append(f"--fit-start {args.fit_start:g} (paper: {PAPER_FIT_START:,.0f} GPU-hours)")
    elif off and _in_gpu_hours(args):
        names = ", ".join(off) if len(off) < len(results) else "every curve"
        out.append(
            f"no warm-up cut for {names}: the fitted range ends at or below 2 x {PAPER_FIT_START:,.0f} GPU-hours "
            f"(paper: cut at {PAPER_FIT_START:,.0f}, --fit-start sets one)"
        )
    elif off:
        out.append(f"no warm-up cut (paper: {PAPER_FIT_START:,.0f} GPU-hours, --fit-start sets one in these units)")
    if args.method == "fast":
        out.append("--method fast (paper: its grid over A and C_mid, --method paper)")
    if args.r0 is not None:
        out.append(f"--r0 {args.r0:g} (paper: R0 is the step-0 evaluation)")
    late = [r.curve.label for r in results if r.curve.steps is not None and r.curve.steps[0] > 1]
    if late:
        out.append(f"R0 of {', '.join(late)} is not a step-0 evaluation (paper: step 0)")
    return out


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="fit", leave=False, disable=None, file=sys.stderr)


def _fit(curves: list[Curve], args: argparse.Namespace) -> tuple[list[Result], list[tuple[Curve, str]]]:
    """Fit every curve that can be fitted; the others are returned with the reason (e.g. a task whose pass
    rate sits at 1.0, too few points after the warm-up cut), so that one unfittable curve does not cost the
    others their fit and plot."""
    results, failed = [], []
    grid_size = len(PAPER_A_GRID) * len(PAPER_C_MID_GRID)
    total = len(curves) * (grid_size if args.method == "paper" else 1)
    with _progress(total, f"fitting ({args.method})") as bar:
        for curve in curves:
            bar.set_postfix_str(curve.label)
            cut = args.extrapolate_from
            if cut == "half":
                cut = float(curve.compute.max()) / 2
            elif cut is not None:
                cut = float(cut)
            try:
                result = fit_run(
                    curve,
                    fit_start=_fit_start(curve, cut, args),
                    method=args.method,
                    n_boot=args.bootstrap,
                    level=args.level,
                    R0=args.r0,
                    extrapolate_from=cut,
                    seed=args.seed,
                    grid_progress=bar.update if args.method == "paper" else None,
                    bootstrap_method=args.bootstrap_method,
                )
            except FitError as exc:
                failed.append((curve, str(exc)))
                continue
            finally:
                if args.method != "paper":
                    bar.update(1)
            results.append(result)
    return results, failed


def _payload(results: list[Result], args: argparse.Namespace, shared: list) -> dict[str, Any]:
    runs = {}
    for r in results:
        entry: dict[str, Any] = {
            "source": r.curve.source,
            "metric": r.curve.metric,
            "runs": r.curve.n_runs,
            **r.fit.as_dict(),
        }
        if r.boot is not None:
            entry.update(level=r.boot.level, bootstrap_method=r.boot.method, phi=r.boot.phi)
            entry.update(r.boot.as_dict())
        entry["predictions"] = []
        for c in args.predict_at:
            value, lo, hi = r.prediction(c)
            entry["predictions"].append({"compute": c, "R": value, "lo": lo, "hi": hi})
        if r.extrapolation is not None:
            entry["extrapolation"] = r.extrapolation.as_dict()
        runs[r.curve.label] = entry
    groups = []
    for g in shared:
        refits = {r.curve.label: {"B": f.B, "C_mid": f.C_mid} for r, f in zip(g.results, g.refits, strict=True)}
        groups.append({"A": g.A, "runs": refits})
    return {
        "axis": args.axis,
        "fit_start": args.fit_start,
        "method": args.method,
        "differs_from_paper": paper_differences(args, results),
        "runs": runs,
        "shared_A": groups,
    }


def _decision(
    results: list[Result], args: argparse.Namespace
) -> tuple[list[Difference], list[Crossover], list[Decision]]:
    """Every pair of fitted curves at each --predict-at, where the fitted curves cross, and the decision
    (winner / undecided / crossover) at each --predict-at, else at the end of the range (scaling/decision.py)."""
    if args.crossover_range:
        span = (args.crossover_range[0], args.crossover_range[1])
    else:
        first = min(float(r.curve.compute[r.curve.compute > 0].min()) for r in results)
        span = (first, max([float(r.curve.compute.max()) for r in results] + args.predict_at))
    start = args.crossover_range[0] if args.crossover_range else None
    decisions = decide_pairs(results, args.predict_at or [span[1]], args.level, args.margin, start)
    return decide(results, args.predict_at), crossovers(results, span), decisions


def _comparable(results: list[Result]) -> bool:
    """Two or more runs (or groups of runs) on one metric: a decision between them means something; the tasks
    or the validation and downstream curves of one run do not compete."""
    metrics, sources = {r.curve.metric for r in results}, {r.curve.source for r in results}
    return len(results) > 1 and len(metrics) == 1 and len(sources) > 1


def check_units(curves: list[Curve]) -> None:
    """Curves compared on one axis must count compute the same way: a CPU run's device-hours are core-hours."""
    kinds = {c.label: c.header.get("device_kind") for c in curves if c.header.get("device_kind")}
    if len(set(kinds.values())) > 1:
        named = ", ".join(f"{label} ({kind})" for label, kind in kinds.items())
        raise FitError(
            f"the runs count compute in different units: {named}; compare runs of one device kind, or rescale one "
            "(--compute-scale applies to every run)"
        )


def _check_args(args: argparse.Namespace) -> str | None:
    if args.extrapolate_from not in (None, "half"):
        try:
            float(args.extrapolate_from)
        except ValueError:
            return f"--extrapolate-from must be a compute or 'half', got {args.extrapolate_from!r}"
    if not 0 < args.level < 1:
        return f"--level must be in (0, 1), got {args.level}"
    if args.bootstrap < 0:
        return f"--bootstrap must be >= 0, got {args.bootstrap}"
    if not args.margin >= 0:
        return f"--margin must be >= 0, got {args.margin}"
    if args.compute_scale <= 0:
        return f"--compute-scale must be > 0, got {args.compute_scale}"
    if args.crossover_range and not 0 < args.crossover_range[0] < args.crossover_range[1]:
        return f"--crossover-range must be 0 < C1 < C2, got {args.crossover_range}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _check_args(args)
    if problem:
        print(f"megatron-rl fit: {problem}", file=sys.stderr)
        return 2
    try:
        curves = _load(args)
        if len(curves) > 1:
            check_units(curves)
        results, failed = _fit(curves, args)
        compare = args.compare and len(results) > 1
        shared = (
            shared_asymptote(
                results, args.margin, n_boot=args.bootstrap, level=args.level, bootstrap_method=args.bootstrap_method
            )
            if compare
            else []
        )
    except FitError as exc:
        print(f"megatron-rl fit: {exc}", file=sys.stderr)
        return 2
    for curve, reason in failed:
        print(f"megatron-rl fit: {curve.label} ({curve.source}) not fitted: {reason}", file=sys.stderr)
    if results:
        print(table(results, args.predict_at, args.axis))
    decision = _decision(results, args) if _comparable(results) and args.bootstrap else None
    if decision is not None:
        print()
        print(decision_table(decision[2], args.level, args.margin))
    if compare:
        print()
        print(shared_table(shared, args.margin))
    if args.extrapolate_from is not None and results:
        print()
        print(extrapolation_table(results))
    if results:
        differences = paper_differences(args, results)
        if differences:
            print("differs from the paper: " + "; ".join(differences))
        else:
            print(f"as in the paper: fit start {PAPER_FIT_START:,.0f} GPU-hours, its grid method, R0 at step 0")
    if args.plot:
        from megatron_rl.scaling.plot import plot_results

        ylabel = "validation pass rate" if args.metric.startswith("val/pass_rate") else args.metric
        if len(_metrics(args)) > 1:
            ylabel = "pass rate (validation and downstream)"
        elif args.metric != "val/pass_rate":
            ylabel += f" ({args.metric})" if ylabel != args.metric else ""
        title = args.title
        written = plot_results(
            results,
            args.plot,
            args.predict_at,
            title=title,
            ylabel=ylabel,
            xlabel=f"compute ({args.compute_col})" if args.compute_col != "device_hours" else "compute (device-hours)",
            efficiency=not args.no_efficiency,
            ordered=args.axis is not None,
            axis=args.axis,
            efficiency_fits={r.curve.label: f for g in shared for r, f in zip(g.results, g.refits, strict=True)},
            unfitted=[curve for curve, _ in failed],
            crossovers=decision[2] if decision is not None else None,
        )
        print("wrote " + ", ".join(map(str, written)))
    if args.json:
        payload = _payload(results, args, shared)
        payload["failed"] = [{"label": c.label, "source": c.source, "reason": reason} for c, reason in failed]
        if decision is not None:
            payload["decision"] = {
                "intervals": "joint bootstrap of the fitted curves (expected R at the compute, not a new evaluation); "
                "verdicts add the run-to-run variation of the runs (margin)",
                "differences": [d.as_dict() for d in decision[0]],
                "crossovers": [c.as_dict() for c in decision[1]],
                "verdicts": [d.as_dict() for d in decision[2]],
            }
        Path(args.json).write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    if failed:
        fitted = f"{len(results)} of {len(results) + len(failed)} curves fitted"
        print(f"megatron-rl fit: {fitted}" + ("" if results else "; the plot shows the points only"), file=sys.stderr)
        return 1 if results else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
