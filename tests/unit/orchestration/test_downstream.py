"""Downstream evaluation: pass@k against exact arithmetic, the benchmark loaders on files in the published
schemas (with bad rows counted and skipped), the metrics, the step line, and `fit` on downstream keys."""

from __future__ import annotations

import base64
import json
import math
import pickle
import statistics
import zlib
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import BenchmarkConfig, ConfigError, load_config
from megatron_rl.data.benchmarks import lcb_cases, lcb_files, load_benchmark
from megatron_rl.data.datasets import DatasetError
from megatron_rl.data.synthetic import HELD_OUT_SUM, arithmetic_rows, large_sum_rows
from megatron_rl.metrics import console_line
from megatron_rl.orchestration.evaluate import gain
from megatron_rl.rollout.evaluation import BenchmarkResult, format_table, ks_for, pass_at_k

# --------------------------------------------------------------------------------------------------
# pass@k and the summaries


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_is_the_unbiased_estimator_in_exact_arithmetic():
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(64, 1, 1) == pytest.approx(1 / 64)
    assert pass_at_k(200, 3, 100) == pytest.approx(float(exact_pass_at_k(200, 3, 100)), rel=1e-12)  # no overflow
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_ks_are_powers_of_two_up_to_n_and_n():
    assert ks_for(1) == [1]
    assert ks_for(16) == [1, 2, 4, 8, 16]
    assert ks_for(6) == [1, 2, 4, 6]


def test_benchmark_result_means_and_standard_errors_match_an_independent_computation():
    passed = {"a": 0, "b": 3, "c": 4, "d": 1, "e": 2}
    result = BenchmarkResult.of("aime24", 4, passed, truncated=0.25)
    per_problem = [c / 4 for c in passed.values()]
    assert result.mean == pytest.approx(statistics.mean(per_problem))
    assert result.mean_se == pytest.approx(statistics.stdev(per_problem) / math.sqrt(5))
    for k in (1, 2, 4):
        values = [float(exact_pass_at_k(4, c, k)) for c in passed.values()]
        assert result.pass_at[k][0] == pytest.approx(statistics.mean(values))
        assert result.pass_at[k][1] == pytest.approx(statistics.stdev(values) / math.sqrt(5))
    assert result.pass_at[1][0] == pytest.approx(result.mean)  # pass@1 is mean@n
    metrics = result.metrics()
    assert metrics["downstream/aime24/mean@4"] == pytest.approx(0.5)
    assert metrics["downstream/aime24/pass@4"] == pytest.approx(0.8)  # 4 of 5 problems solved at least once
    assert metrics["downstream/aime24/problems"] == 5 and metrics["downstream/aime24/truncation_rate"] == 0.25
    table = format_table({"aime24": result})
    assert "aime24" in table and "0.500 ±" in table and "pass@4" in table
    assert json.loads(json.dumps(result.as_dict()))["pass_at"]["4"]["value"] == pytest.approx(0.8)


def test_gain_is_paired_over_problems():
    start = BenchmarkResult.of("m", 4, {"a": 0, "b": 2, "c": 4, "d": 1}, 0.0)
    end = BenchmarkResult.of("m", 4, {"a": 1, "b": 4, "c": 4, "d": 1, "extra": 4}, 0.0)
    diffs = [0.25, 0.5, 0.0, 0.0]  # per common problem
    paired = gain(start, end)
    assert paired is not None
    assert paired[0] == pytest.approx(statistics.mean(diffs))
    assert paired[1] == pytest.approx(statistics.stdev(diffs) / 2)


def test_a_benchmark_whose_problems_were_all_too_long_is_n_a_not_zero(tmp_path, capsys):
    """Every problem skipped as longer than rollout.max_prompt_tokens: no pass rate at all, shown as such in the
    table, the training row, results.json and the gain, with the skipped problems counted beside it."""
    from megatron_rl.orchestration.evaluate import Target, _report

    empty = BenchmarkResult.of("aime24", 4, {}, None, skipped_long=30)
    some = BenchmarkResult.of("math500", 4, {"a": 2, "b": 4}, 0.0, skipped_long=3)
    table = format_table({"aime24": empty, "math500": some})
    head, _, aime, math500 = table.splitlines()
    assert head.split()[:5] == ["benchmark", "problems", "skipped", "n", "mean@n"]
    assert aime.split() == ["aime24", "0", "30", "4", *["n/a"] * 4] and "0.000" not in aime  # mean, pass@2, @4, trunc
    assert math500.split()[:5] == ["math500", "2", "3", "4", "0.750"]
    # the training run's row: counts only, so neither the step line nor a fitted curve reads a 0 pass rate
    assert empty.metrics() == {"downstream/aime24/problems": 0.0, "downstream/aime24/skipped_long": 30.0}
    assert "aime24" not in console_line(2, {"val/pass_rate": 0.5, **empty.metrics(), **some.metrics()})
    assert some.metrics()["downstream/math500/skipped_long"] == 3.0
    assert gain(empty, empty) is None

    run = load_config("scalerl-cpu", None, [])
    targets = [Target("start", tmp_path / "start"), Target("checkpoint", tmp_path / "end")]
    by_model = {t.label: (t.path, {"aime24": empty}) for t in targets}
    _report(run, targets, by_model, tmp_path, None)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "0.000" not in out and "aime24: n/a" in out
    saved = json.loads((tmp_path / "results.json").read_text())  # strict JSON: null, never NaN
    result = saved["models"]["checkpoint"]["results"]["aime24"]
    assert (result["mean"], result["mean_se"], result["problems"], result["skipped_long"]) == (None, None, 0, 30)
    assert saved["gain"]["aime24"] == {"mean": None, "se": None}


def test_the_step_line_shows_each_benchmark_beside_validation():
    row = {"val/pass_rate": 0.5, "downstream/aime24/mean@16": 0.133, "downstream/aime24/mean@16_se": 0.02}
    row["downstream/aime24/pass@16"] = 0.4
    line = console_line(7, row)
    assert "val 0.500 | aime24 0.133" in line and "0.020" not in line and "0.400" not in line


# --------------------------------------------------------------------------------------------------
# Loaders, one per published schema


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows))
    return str(path)


def test_aime24_in_the_huggingfaceh4_schema(tmp_path):
    rows = [
        {
            "id": 60,
            "problem": "Every morning Aya goes for a walk...",
            "solution": "...",
            "answer": "204",
            "url": "u",
            "year": 2024,
        },  # fmt: skip
        {"id": 61, "problem": "Let ABC be a triangle...", "solution": "...", "answer": "113", "url": "u", "year": 2024},
        {"id": 62, "problem": "A row without its answer", "solution": "...", "url": "u", "year": 2024},
        "{not json",
    ]
    bench = load_benchmark(BenchmarkConfig("aime24", source=_jsonl(tmp_path / "aime24.jsonl", rows)))
    assert [p.id for p in bench.prompts] == ["aime24-60", "aime24-61"]
    assert bench.prompts[0].answer == "204" and bench.prompts[0].task == "math"
    assert (bench.rows, bench.skipped) == (4, 2)
    assert "aime24.jsonl: row 3: field 'answer' missing" in bench.errors[0]
    assert "row 4" in bench.errors[1] and "JSON" in bench.errors[1]


def test_aime25_in_both_published_schemas_from_parquet(tmp_path):
    # yentinglin/aime_2025 (problem, answer as text) and opencompass/AIME2025 (question, answer)
    columns = {"id": ["I-1", "I-2"], "problem": ["Find the sum of all integer bases...", "x"], "answer": ["70", "588"]}
    table = pa.table({**columns, "solution": ["", ""], "url": ["", ""], "year": ["2025", "2025"]})
    pq.write_table(table, tmp_path / "aime25.parquet")
    bench = load_benchmark(BenchmarkConfig("aime25", source=str(tmp_path / "aime25.parquet")))
    assert [(p.id, p.answer) for p in bench.prompts] == [("aime25-I-1", "70"), ("aime25-I-2", "588")]
    opencompass = [{"question": "Find the sum of all integer bases b > 9...", "answer": 70}]
    bench = load_benchmark(BenchmarkConfig("aime25", source=_jsonl(tmp_path / "oc.jsonl", opencompass)))
    assert bench.prompts[0].prompt.startswith("Find the sum") and bench.prompts[0].answer == "70"


def test_math500_rows_with_unparsable_answers_are_counted_and_skipped(tmp_path):
    base = {"solution": "...", "subject": "Algebra", "level": 3}
    rows = [
        {
            **base,
            "problem": "Convert (0,3) to polar",
            "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
            "unique_id": "test/precalculus/807.json",
        },  # fmt: skip
        {**base, "problem": "Which is the same?", "answer": "\\text{(C)}", "unique_id": "test/algebra/1.json"},
        {**base, "problem": "Broken", "answer": "}{", "unique_id": "test/algebra/2.json"},
        {**base, "answer": "3", "unique_id": "test/algebra/3.json"},
    ]
    bench = load_benchmark(BenchmarkConfig("math500", source=_jsonl(tmp_path / "math500.jsonl", rows)))
    assert [p.id for p in bench.prompts] == ["math500-test/precalculus/807.json", "math500-test/algebra/1.json"]
    assert bench.skipped == 2
    assert "math500.jsonl: row 3: field 'answer' '}{' does not parse" in bench.errors[0]
    assert "math500.jsonl: row 4: field 'problem' missing" in bench.errors[1]


def test_a_benchmark_without_a_valid_row_and_an_unknown_name_are_refused(tmp_path):
    with pytest.raises(DatasetError, match=r"bad.jsonl: no valid rows \(1 of 1 skipped\); first: .*field 'answer'"):
        load_benchmark(BenchmarkConfig("math500", source=_jsonl(tmp_path / "bad.jsonl", [{"problem": "p"}])))
    with pytest.raises(ConfigError, match=r"eval.downstream.benchmarks\[1\].name: unknown benchmark 'aime23'"):
        load_config("scalerl-cpu", None, ["eval.downstream.benchmarks=[aime24,aime23]"])
    with pytest.raises(ConfigError, match="listed twice"):
        load_config("scalerl-cpu", None, ["eval.downstream.benchmarks=[aime24,aime24]"])
    with pytest.raises(ConfigError, match="start_date: expected a date"):
        BenchmarkConfig("livecodebench", start_date="Aug 2024")
    shorthand = load_config("scalerl-cpu", None, ["eval.downstream.benchmarks=[math500=/data/m.jsonl]"])
    assert shorthand.eval.downstream.benchmarks[0] == BenchmarkConfig("math500", source="/data/m.jsonl")


def _compressed(cases: list[dict]) -> str:
    """LiveCodeBench's private-test encoding: base64(zlib(pickle(JSON text)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(cases)))).decode()


def _lcb_row(qid: str, date: str, **over) -> dict:
    row = {
        "question_title": "t",
        "question_content": f"Problem {qid}.",
        "platform": "atcoder",
        "question_id": qid,
        "contest_id": "abc",
        "contest_date": f"{date}T00:00:00",
        "starter_code": "",
        "difficulty": "easy",
        "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "private_test_cases": _compressed([{"input": "5 7\n", "output": "12\n", "testtype": "stdin"}]),
        "metadata": "{}",
    }
    row.update(over)
    return row


class _Boom:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


def test_livecodebench_schema_window_versions_and_forged_pickles(tmp_path, capsys):
    functional = _lcb_row(
        "2999",
        "2024-09-01",
        platform="leetcode",
        starter_code="class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n        ",
        public_test_cases=json.dumps([{"input": "[2,7,11,15]\n9", "output": "[0, 1]", "testtype": "functional"}]),
        private_test_cases=_compressed([{"input": "[3,3]\n6", "output": "[0, 1]", "testtype": "functional"}]),
        metadata=json.dumps({"func_name": "twoSum"}),
    )
    forged = base64.b64encode(zlib.compress(pickle.dumps(_Boom()))).decode()
    rows = [
        _lcb_row("abc360_a", "2024-08-15"),
        functional,
        _lcb_row("abc300_a", "2023-05-01"),  # before the window: not a bad row, not loaded
        _lcb_row("abc361_b", "2024-10-01", private_test_cases=forged),
        _lcb_row("abc362_c", "2024-11-01", public_test_cases="[{'input': 1"),
    ]
    source = _jsonl(tmp_path / "test5.jsonl", rows)
    bench = load_benchmark(BenchmarkConfig("livecodebench", source=source))
    assert "unpickled code ran" not in capsys.readouterr().out
    assert [p.id for p in bench.prompts] == ["livecodebench-abc360_a", "livecodebench-2999"]
    stdin, call = bench.prompts
    expected = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"], "compare": "decimal"}  # LCB's grader
    assert stdin.task == "code" and stdin.tests == expected
    assert "standard input" in stdin.prompt
    assert call.tests == {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 3], 6]], "outputs": [[0, 1]] * 2}
    assert "class Solution" in call.prompt and "def twoSum" in call.prompt
    assert (bench.rows, bench.skipped) == (4, 2)
    assert "row 4: field 'private_test_cases'" in bench.errors[0] and "refused" in bench.errors[0]
    assert "row 5: field 'public_test_cases'" in bench.errors[1]
    assert bench.window == "release_v5, contests 2024-08-01 .. 2025-02-01"
    wide = load_benchmark(BenchmarkConfig("livecodebench", source=source, start_date=None, end_date=None))
    assert len(wide.prompts) == 3


def test_livecodebench_versions_name_its_release_files(tmp_path):
    assert lcb_files("release_v1") == ["test.jsonl"]
    assert lcb_files("release_v5") == ["test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl"]
    assert lcb_files("v5") == ["test5.jsonl"]
    assert len(lcb_files("release_latest")) == 6
    with pytest.raises(DatasetError, match="version 'v9' is not a release tag"):
        lcb_files("v9")
    # a downloaded copy of the dataset repository: the version's files are read from it
    for n, name in enumerate(lcb_files("release_v2")):
        _jsonl(tmp_path / name, [_lcb_row(f"q{n}", "2024-09-01")])
    both = load_benchmark(BenchmarkConfig("livecodebench", source=str(tmp_path), version="release_v2"))
    assert [p.id for p in both.prompts] == ["livecodebench-q0", "livecodebench-q1"]
    assert [p.id for p in load_benchmark(BenchmarkConfig("livecodebench", source=str(tmp_path), version="v2")).prompts]\
        == ["livecodebench-q1"]  # fmt: skip
    with pytest.raises(DatasetError, match="test3.jsonl missing"):
        load_benchmark(BenchmarkConfig("livecodebench", source=str(tmp_path), version="release_v3"))
    assert lcb_cases(json.dumps([{"input": "1", "output": "1"}]), "w", "f") == [{"input": "1", "output": "1"}]


def test_the_cpu_downstream_set_is_held_out_of_training_by_construction():
    training = {(r["prompt"]) for r in arithmetic_rows(0)}
    held_out = large_sum_rows()
    assert len(held_out) == 190 and len(training) == 100 * 100 - 190
    assert all(int(r["answer"]) >= HELD_OUT_SUM for r in held_out)
    assert not training & {r["problem"] for r in held_out}
    bench = load_benchmark(BenchmarkConfig("synthetic_large"))
    assert len(bench.prompts) == 190 and bench.prompts[0].answer == str(
        sum(map(int, held_out[0]["problem"][8:-1].split(" + ")))
    )
    config = load_config("scalerl-cpu")
    assert [b.name for b in config.eval.downstream.benchmarks] == ["synthetic_large"]


# --------------------------------------------------------------------------------------------------
# fit on downstream keys


def test_fit_fits_downstream_keys_beside_validation(tmp_path):
    from megatron_rl.scaling.cli import main as fit_main

    rows = [{"run": {"name": "demo"}}]
    for i in range(12):
        c = 0.01 * (i + 1)
        val = 0.3 + 0.5 / (1 + (0.04 / c) ** 1.5)
        aime = 0.1 + 0.3 / (1 + (0.05 / c) ** 1.2)
        rows.append({"step": i * 10, "device_hours": c, "val/pass_rate": val, "downstream/aime24/mean@4": aime,
                     "downstream/aime24/mean@4_se": 0.01})  # fmt: skip
    path = _jsonl(tmp_path / "metrics.jsonl", rows)
    out = tmp_path / "fit.json"
    code = fit_main([path, "--metric", "val/pass_rate,downstream/aime24/mean@4", "--bootstrap", "0",
                     "--json", str(out), "--plot", str(tmp_path / "fit.png")])  # fmt: skip
    assert code == 0
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"demo val/pass_rate", "demo downstream/aime24/mean@4"}
    assert runs["demo downstream/aime24/mean@4"]["A"] > 0.3 and runs["demo val/pass_rate"]["A"] > 0.7
    assert (tmp_path / "fit.png").stat().st_size > 0
    # side by side, each curve is fitted exactly as it is alone
    for metric in ("val/pass_rate", "downstream/*/mean@4"):
        alone = tmp_path / "alone.json"
        assert fit_main([path, "--metric", metric, "--bootstrap", "0", "--json", str(alone)]) == 0
        (fit,) = json.loads(alone.read_text())["runs"].values()
        key = "demo val/pass_rate" if metric == "val/pass_rate" else "demo downstream/aime24/mean@4"
        assert (fit["A"], fit["B"], fit["C_mid"]) == (runs[key]["A"], runs[key]["B"], runs[key]["C_mid"])


# --------------------------------------------------------------------------------------------------
# megatron-rl eval: what it refuses before starting anything


def test_eval_refuses_a_checkpoint_without_a_tokenizer_and_a_run_without_benchmarks(tmp_path, capsys):
    from megatron_rl.cli import main

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    args = ["eval", "--checkpoint", str(hf), "--recipe", "scalerl-cpu"]
    assert main([*args, "--benchmarks", "synthetic_large"]) == 2
    err = capsys.readouterr().err
    assert f"{hf}: no tokenizer" in err and "tokenizer.json" in err
    assert main([*args, "eval.downstream.benchmarks=[]"]) == 2
    assert "no benchmarks: give --benchmarks" in capsys.readouterr().err
    assert main([*args, "--benchmarks", "aime23"]) == 2
    assert "unknown benchmark 'aime23'" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2  # neither an HF directory nor a run
    assert "neither a Hugging Face directory" in capsys.readouterr().err
    (hf / "tokenizer.json").write_text("{}")
    assert main([*args, "--start", "--benchmarks", "synthetic_large"]) == 2
    assert "--start" in capsys.readouterr().err
