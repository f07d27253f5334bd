"""`megatron-rl fit`: fit, predict and compare scaling curves from metrics files.

megatron-rl fit runs/*/metrics.jsonl --fit-start 1500 --predict-at 100000 --plot out.png
megatron-rl fit a.jsonl b.jsonl --compare                       # the paper's A-margin rule
megatron-rl fit export.csv --compute-col gpu_hours --metric val/pass_rate
megatron-rl fit run.jsonl --extrapolate-from 50000              # fit up to 50k, predict the rest
megatron-rl fit name=path.jsonl ...                             # label runs on the command line
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_rl.scaling.compare import fit_all, shared_asymptote, table
from megatron_rl.scaling.curves import load_curve
from megatron_rl.scaling.fit import FitError, extrapolation_check


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-rl fit", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="metrics JSONL or CSV files, optionally as label=path")
    p.add_argument("--fit-start", type=float, default=0.0, help="warm-up cut in compute units (paper: 1500)")
    p.add_argument("--predict-at", type=float, default=None, help="report R (with interval) at this compute")
    p.add_argument("--plot", default=None, help="write the figure here (.png or .svg)")
    p.add_argument("--method", choices=["fast", "paper"], default="fast")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap refits for intervals (0 = none)")
    p.add_argument("--compute-col", default="device_hours")
    p.add_argument("--metric", default="val/pass_rate", help="e.g. val/pass_rate/math for one task's curve")
    p.add_argument("--r0", type=float, default=None, help="R0 (default: the lowest-compute point)")
    p.add_argument("--compare", action="store_true", help="refit with a shared A when A's are within --margin")
    p.add_argument("--margin", type=float, default=0.02)
    p.add_argument("--extrapolate-from", type=float, default=None, help="fit up to this compute, predict the rest")
    p.add_argument("--json", default=None, help="also write the fitted parameters as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        curves = []
        for spec in args.runs:
            label, _, path = spec.rpartition("=") if "=" in spec and not Path(spec).exists() else ("", "", spec)
            curves.append(load_curve(path, args.compute_col, args.metric, label or None))
        results = fit_all(curves, args.fit_start, args.method, args.bootstrap, args.r0)
    except FitError as exc:
        print(f"megatron-rl fit: {exc}", file=sys.stderr)
        return 2
    print(table(results, args.predict_at))
    if args.compare:
        shared = shared_asymptote(results, args.margin)
        if shared is None:
            print(f"A's differ by more than {args.margin}: compare the asymptotes (A) directly")
        else:
            mean_A, refits = shared
            print(f"A's within {args.margin}: refit with shared A={mean_A:.3f}; compare efficiency B:")
            for r, f in zip(results, refits, strict=True):
                print(f"  {r.curve.label:<28} B={f.B:.3f}  C_mid={f.C_mid:.4g}")
    if args.extrapolate_from is not None:
        for r in results:
            try:
                e = extrapolation_check(r.curve.compute, r.curve.R, args.extrapolate_from, args.fit_start, args.r0)
            except FitError as exc:
                print(f"{r.curve.label}: extrapolation check: {exc}")
                continue
            print(
                f"{r.curve.label}: fit to {e.cut:g}, predict {e.last_compute:g}: {e.predicted:.3f} "
                f"[{e.interval[0]:.3f}, {e.interval[1]:.3f}] vs observed {e.last_observed:.3f} (error {e.error:+.3f})"
            )
    if args.plot:
        from megatron_rl.scaling.plot import plot_results

        print(f"wrote {plot_results(results, args.plot, args.predict_at)}")
    if args.json:
        payload = {r.curve.label: r.fit.as_dict() for r in results}
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
