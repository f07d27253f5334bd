"""`megatron-rl fit`, the recipe comparison and the figure."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rl.cli import main as top_main
from megatron_rl.scaling.cli import build_parser, paper_differences
from megatron_rl.scaling.cli import main as fit_main
from megatron_rl.scaling.compare import Result, shared_asymptote
from megatron_rl.scaling.curves import Curve, load_curves
from megatron_rl.scaling.fit import fit_curve
from megatron_rl.scaling.plot import plot_results
from megatron_rl.scaling.synthetic import synthetic_curve, write_metrics_jsonl


def _run(path, name, A, B, C_mid, seed, **header):
    compute, R = synthetic_curve(A, B, C_mid, noise=0.005, seed=seed, max_compute=25000)
    return write_metrics_jsonl(path, compute, R, {"name": name, **header})


def _result(label, A, B, C_mid, seed):
    compute, R = synthetic_curve(A, B, C_mid, noise=0.004, seed=seed, max_compute=25000)
    return Result(Curve(label, compute, R, label), fit_curve(compute, R, fit_start=1500), None)


def test_the_readme_command_fits_predicts_and_plots(tmp_path, capsys):
    runs = tmp_path / "runs"
    _run(runs / "a.jsonl", "recipe-a", 0.61, 1.92, 2542, 1)
    _run(runs / "b.jsonl", "recipe-b", 0.66, 1.50, 4000, 2)
    out = tmp_path / "out.png"
    argv = [str(runs / "a.jsonl"), str(runs / "b.jsonl"), "--fit-start", "1500", "--predict-at", "100000"]
    assert top_main(["fit", *argv, "--plot", str(out), "--bootstrap", "100", "--json", str(tmp_path / "f.json")]) == 0
    text = capsys.readouterr().out
    assert "recipe-a" in text and "recipe-b" in text and "R@100000" in text and "90% bootstrap intervals" in text
    assert out.read_bytes()[:4] == b"\x89PNG" and out.stat().st_size > 20_000
    fitted = json.loads((tmp_path / "f.json").read_text())["runs"]
    assert abs(fitted["recipe-a"]["A"] - 0.61) < 0.01 and abs(fitted["recipe-b"]["B"] / 1.5 - 1) < 0.1
    a = fitted["recipe-a"]
    assert a["A_lo"] < a["A"] < a["A_hi"]
    prediction = a["predictions"][0]
    assert prediction["compute"] == 100000 and prediction["lo"] < prediction["R"] < prediction["hi"]


def test_compare_extrapolate_and_label_runs_on_the_command_line(tmp_path, capsys):
    a = _run(tmp_path / "a.jsonl", "x", 0.61, 2.2, 2500, 1)
    b = _run(tmp_path / "b.jsonl", "y", 0.62, 1.5, 2500, 2)
    argv = [f"fast={a}", f"slow={b}", "--fit-start", "1500", "--compare", "--extrapolate-from", "half"]
    assert fit_main([*argv, "--bootstrap", "100", "--json", str(tmp_path / "f.json")]) == 0
    text = capsys.readouterr().out
    assert "refitted with their mean A" in text
    ranking = [line.split()[0] for line in text.splitlines() if line.startswith("  ") and "B=" in line]
    assert ranking == ["fast", "slow"]  # higher B first
    assert "fit up to 12500, predict 25000" in text
    payload = json.loads((tmp_path / "f.json").read_text())
    check = payload["runs"]["fast"]["extrapolation"]
    assert abs(check["error"]) < 0.02 and check["lo"] < check["predicted"] < check["hi"]
    (group,) = payload["shared_A"]
    assert set(group["runs"]) == {"fast", "slow"} and group["A"] == pytest.approx(np.mean([0.61, 0.62]), abs=0.01)


def test_scaling_axis_from_the_header_sorts_numerically_and_plots(tmp_path, capsys):
    for batch, C_mid in ((2048, 10909), (512, 2818), (768, 2542)):
        compute, R = synthetic_curve(0.62, 1.8, C_mid, noise=0.005, seed=batch, max_compute=10 * C_mid)
        write_metrics_jsonl(
            tmp_path / f"b{batch}" / "metrics.jsonl", compute, R, {"name": "r", "labels": {"batch": batch}}
        )
    out = tmp_path / "axis.svg"
    runs = [str(tmp_path / f"b{b}") for b in (2048, 512, 768)]  # run directories hold metrics.jsonl
    assert (
        fit_main([*runs, "--axis", "labels.batch", "--fit-start", "1500", "--plot", str(out), "--bootstrap", "50"]) == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("labels.batch")
    assert [line.split()[0] for line in lines[1:4]] == ["512", "768", "2048"]
    assert out.read_text().lstrip().startswith("<?xml") and out.with_suffix(".png").is_file()


def test_errors_exit_2_with_the_reason(tmp_path, capsys):
    path = _run(tmp_path / "a.jsonl", "a", 0.61, 1.92, 2542, 1)
    assert fit_main([str(path), "--metric", "val/pass_rate/code"]) == 2
    assert "column 'val/pass_rate/code' missing" in capsys.readouterr().err
    assert fit_main([str(path), "--fit-start", "24000"]) == 2
    assert "only 3 points after the warm-up cut (fit_start=24000, last compute 25000)" in capsys.readouterr().err
    twin = _run(tmp_path / "b.jsonl", "a", 0.61, 1.92, 2542, 2)  # a different run whose header name is also "a"
    assert fit_main([str(path), str(twin)]) == 2
    assert "share the labels ['a']" in capsys.readouterr().err
    assert fit_main([f"a={path}", f"a={path}"]) == 2
    assert "the same file is given twice for 'a'" in capsys.readouterr().err
    assert fit_main([str(path), "--extrapolate-from", "soon"]) == 2
    assert "'half', got 'soon'" in capsys.readouterr().err
    assert fit_main([str(path), "--level", "90"]) == 2
    assert "--level must be in (0, 1)" in capsys.readouterr().err
    assert fit_main([str(path), "--axis", "labels.batch"]) == 2
    assert "label key 'labels.batch'" in capsys.readouterr().err


def test_shared_asymptote_groups_runs_within_the_margin():
    results = [
        _result("a", 0.600, 2.2, 2500, 1),
        _result("b", 0.612, 1.6, 2500, 2),
        _result("c", 0.700, 1.8, 3000, 3),  # far above: compared on A, not refitted
        _result("d", 0.705, 1.8, 3000, 4),
    ]
    groups = shared_asymptote(results, margin=0.02, n_boot=30)
    assert [[r.curve.label for r in g.results] for g in groups] == [["a", "b"], ["c", "d"]]
    ab = groups[0]
    assert pytest.approx((results[0].fit.A + results[1].fit.A) / 2) == ab.A
    assert all(f.A == ab.A for f in ab.refits)
    assert [r.curve.label for r, _, _ in ab.ranking()] == ["a", "b"]
    assert ab.boots[0].interval("B")[0] > ab.boots[1].interval("B")[1]  # B's intervals separate
    assert shared_asymptote(results[1:3], margin=0.02) == []


def test_plot_draws_every_run_on_a_log_compute_axis(tmp_path):
    import matplotlib.image

    results = [_result("a", 0.6, 2.2, 2500, 1), _result("b", 0.7, 1.6, 4000, 2)]
    (png,) = plot_results(results, tmp_path / "p.png", predict_at=[50000], efficiency=False)
    image = matplotlib.image.imread(png)
    assert image.shape[0] > 400 and image.shape[1] > 700
    assert image[..., :3].std() > 0.1  # not blank


def test_a_curve_that_cannot_be_fitted_is_named_and_the_others_are_fitted_and_plotted(tmp_path, capsys):
    """Per task (`--metric 'val/pass_rate/*'`), a task at pass rate 1.0 has no sigmoid to fit: it is named on
    stderr and under "failed", exit 1, and the other task still gets its fit and the plot (the run's final
    per-task fit writes `scaling_curve_tasks.png` this way)."""
    compute, R = synthetic_curve(0.61, 1.92, 2542, noise=0.005, seed=1, max_compute=25000)
    path = write_metrics_jsonl(tmp_path / "m.jsonl", compute, R, {"name": "mt"}, {"math": R, "code": np.ones_like(R)})
    out, report = tmp_path / "tasks.png", tmp_path / "f.json"
    argv = [str(path), "--metric", "val/pass_rate/*", "--bootstrap", "50", "--plot", str(out), "--json", str(report)]
    assert fit_main(argv) == 1
    captured = capsys.readouterr()
    assert "code" in captured.err and "not fitted" in captured.err and "1 of 2 curves fitted" in captured.err
    assert "math" in captured.out
    payload = json.loads(report.read_text())
    assert [f["label"] for f in payload["failed"]] == ["mt code"] and "A_max" in payload["failed"][0]["reason"]
    assert list(payload["runs"]) == ["mt math"]
    assert out.read_bytes()[:4] == b"\x89PNG"

    assert fit_main([str(path), "--metric", "val/pass_rate/code", "--plot", str(tmp_path / "none.png")]) == 2
    assert "0 of 1 curves fitted; the plot shows the points only" in capsys.readouterr().err
    assert (tmp_path / "none.png").read_bytes()[:4] == b"\x89PNG"


def test_a_partial_last_line_is_left_out_with_a_warning_a_bad_line_inside_is_an_error(tmp_path, capsys):
    path = _run(tmp_path / "a.jsonl", "a", 0.61, 1.92, 2542, 1)
    with path.open("a") as f:
        f.write('{"step": 99999, "device_hours": 3')  # the writer was killed mid-row
    with pytest.warns(UserWarning, match=r"a\.jsonl:\d+: a partial last line"):
        assert fit_main([str(path), "--bootstrap", "0"]) == 0
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1][:10], *lines[2:-1]]) + "\n")
    assert fit_main([str(path), "--bootstrap", "0"]) == 2
    assert "a.jsonl:2: not JSON" in capsys.readouterr().err


def test_repeated_runs_under_one_label_are_one_curve_whose_intervals_include_their_spread(tmp_path, capsys):
    runs = [_run(tmp_path / f"a{i}.jsonl", f"seed{i}", A, 1.9, 2500, i) for i, A in enumerate([0.60, 0.62, 0.61])]
    other = _run(tmp_path / "b.jsonl", "b", 0.66, 1.5, 4000, 9)
    argv = [*(f"recipe={p}" for p in runs), f"other={other}", "--fit-start", "1500", "--compare", "--bootstrap", "200"]
    assert fit_main([*argv, "--json", str(tmp_path / "f.json"), "--plot", str(tmp_path / "p.png")]) == 0
    text = capsys.readouterr().out
    header, recipe, row_b = text.splitlines()[:3]
    assert header.split()[-2:] == ["runs", "phi"] and recipe.split()[0] == "recipe" and row_b.split()[0] == "other"
    assert "intervals include run-to-run variation" in text
    payload = json.loads((tmp_path / "f.json").read_text())["runs"]
    assert payload["recipe"]["runs"] == 3 and payload["other"]["runs"] == 1
    assert payload["recipe"]["n_points"] == 3 * 71 and payload["recipe"]["bootstrap_method"] == "ar"
    assert payload["recipe"]["A_lo"] < 0.605 and payload["recipe"]["A_hi"] > 0.615  # the runs' spread

    assert fit_main([str(runs[0]), "--fit-start", "1500", "--bootstrap", "100", "--bootstrap-method", "iid"]) == 0
    text = capsys.readouterr().out
    assert "residuals resampled independently" in text and "cover the noise within each run" in text


def _differences(text):
    (line,) = [x for x in text.splitlines() if x.startswith(("differs from the paper: ", "as in the paper: "))]
    return line


def test_the_warm_up_cut_defaults_to_the_papers_on_gpu_hours_and_every_run_says_what_differs(tmp_path, capsys):
    long = _run(tmp_path / "long.jsonl", "long", 0.61, 1.92, 2542, 1)  # up to 25,000 device-hours
    compute, R = synthetic_curve(0.61, 1.92, 800, noise=0.005, seed=2, max_compute=2800)
    short = write_metrics_jsonl(tmp_path / "short.jsonl", compute, R, {"name": "short"})  # ends below 2 x 1,500
    report = tmp_path / "f.json"
    assert fit_main([str(long), str(short), "--bootstrap", "0", "--json", str(report)]) == 0
    line = _differences(capsys.readouterr().out)
    payload = json.loads(report.read_text())
    assert payload["fit_start"] is None
    assert payload["runs"]["long"]["fit_start"] == 1500 and payload["runs"]["short"]["fit_start"] == 0
    assert payload["differs_from_paper"] == line.removeprefix("differs from the paper: ").split("; ")
    assert [x.split(" (")[0].split(":")[0] for x in payload["differs_from_paper"]] == [
        "no warm-up cut for short",
        "--method fast",
    ]

    # An explicit --fit-start is honoured whatever the curve (the training loop passes one).
    assert fit_main([str(long), str(short), "--fit-start", "0", "--bootstrap", "0", "--json", str(report)]) == 0
    assert "--fit-start 0 (paper: 1,500 GPU-hours)" in _differences(capsys.readouterr().out)
    assert {r["fit_start"] for r in json.loads(report.read_text())["runs"].values()} == {0}
    assert fit_main([str(short), "--fit-start", "1500", "--bootstrap", "0", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["runs"]["short"]["fit_start"] == 1500
    assert (
        _differences(capsys.readouterr().out)
        == "differs from the paper: --method fast (paper: its grid over A and C_mid, --method paper)"
    )

    # Compute in other units: no default cut; R0 given instead of measured.
    assert fit_main([str(long), "--compute-col", "step", "--r0", "0.3", "--bootstrap", "0", "--json", str(report)]) == 0
    line = _differences(capsys.readouterr().out)
    assert "compute column 'step' (paper: GPU-hours)" in line and "no warm-up cut (paper: 1,500" in line
    assert "--r0 0.3 (paper: R0 is the step-0 evaluation)" in line
    assert json.loads(report.read_text())["runs"]["long"]["fit_start"] == 0

    # The paper's own choices: nothing to list.
    args = build_parser().parse_args([str(long), "--method", "paper"])
    (curve,) = load_curves(long)
    result = Result(curve, fit_curve(curve.compute, curve.R, fit_start=1500), None)
    assert paper_differences(args, [result]) == []
