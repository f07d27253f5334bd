"""The scaling figure of docs/guide.md §10 (docs/scaling_example.png), made by `megatron-rl fit` from synthetic runs.

    OMP_NUM_THREADS=1 python benchmarks/bench_scaling_example.py [--out docs/scaling_example.png] [--keep DIR]

Three runs along the batch-size axis with the paper's Table 1 parameters (batch 512, 768 = the ScaleRL 8B
run, 2048), each trained to 100k GPU-hours with an evaluation every 100 steps (75 points, noise 0.008), are
written as metrics JSONL files the way megatron_rl writes them (the batch size in the header's labels).
The figure is then made by the command a user would run: fit after the 1.5k GPU-hour warm-up on the
points up to 50k GPU-hours, predict 100k (the paper's Figure 1 protocol), and compare the recipes.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from megatron_rl.scaling.cli import main as fit_main
from megatron_rl.scaling.synthetic import TABLE1, synthetic_curve, write_metrics_jsonl

RUNS = {"batch-512": 512, "scalerl-8b": 768, "batch-2048": 2048}


def write_runs(directory: Path) -> list[Path]:
    paths = []
    for i, (name, batch) in enumerate(RUNS.items()):
        C_mid, B, A = TABLE1[name]
        compute, R = synthetic_curve(A, B, C_mid, noise=0.008, seed=10 + i, max_compute=100_000)
        header = {"name": name, "recipe": "scalerl", "model": "llama3_8b", "labels": {"batch": batch}}
        paths.append(write_metrics_jsonl(directory / name / "metrics.jsonl", compute, R, header))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/scaling_example.png")
    parser.add_argument("--keep", default=None, help="write the synthetic runs here instead of a temporary folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = write_runs(Path(args.keep or tmp))
        argv = [*map(str, runs), "--fit-start", "1500", "--predict-at", "100000", "--axis", "labels.batch"]
        argv += ["--extrapolate-from", "50000", "--compare", "--plot", args.out]
        argv += ["--title", "batch size: fit up to 50k GPU-hours (solid), predict 100k (dashed); x: held out"]
        print("megatron-rl fit " + " ".join(argv))
        raise SystemExit(fit_main(argv))


if __name__ == "__main__":
    main()
