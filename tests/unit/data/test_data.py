"""Datasets: schema errors name file/row/field, skipping counts, deterministic splits, the sampler."""

import json
import random

import pytest

from megatron_rl.algo.filters import NoPositiveResampling
from megatron_rl.config import DataConfig, DatasetConfig
from megatron_rl.data.datasets import DatasetError, load_prompts, load_splits
from megatron_rl.data.sampler import CurriculumSampler
from megatron_rl.data.synthetic import arithmetic_rows, arithmetic_solution


def _write(tmp_path, rows, name="set.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_arithmetic_solution_is_correct_for_every_problem():
    for row in arithmetic_rows(max_operand=99)[:2000]:
        solution = arithmetic_solution(row["prompt"])
        assert solution.endswith(f"\\boxed{{{row['answer']}}}")
        # Each column step's arithmetic is right: "da+db(+1)=total".
        for step in solution.removeprefix("<think>").split("</think>")[0].split():
            lhs, rhs = step.split("=")
            assert sum(int(x) for x in lhs.split("+")) == int(rhs)


def test_slipped_solutions_reach_a_wrong_answer_consistently():
    """With slips, a column sum is off by one at the given rate, and the carries and the boxed answer follow the
    sums as written: the warm-up teaches the method plus an error rate, not inconsistent arithmetic."""
    rng, slipped, columns, wrong = random.Random(0), 0, 0, 0
    rows = arithmetic_rows(max_operand=99)[:3000]
    for row in rows:
        solution = arithmetic_solution(row["prompt"], slip=0.3, rng=rng)
        steps = solution.removeprefix("<think>").split("</think>")[0].split()
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        carry, digits = 0, []
        for column, step in enumerate(steps):
            lhs, rhs = step.split("=")
            terms = [int(x) for x in lhs.split("+")]
            if column < len(str(max(a, b))):  # the operands' own digits, and the carry that was written
                assert terms[:2] == [a // 10**column % 10, b // 10**column % 10]
                assert (len(terms) == 3) == bool(carry)
                columns += 1
                slipped += abs(int(rhs) - sum(terms)) == 1
                assert abs(int(rhs) - sum(terms)) <= 1
            carry = int(rhs) // 10
            digits.append(int(rhs) % 10 if column < len(str(max(a, b))) else int(rhs))
        answer = int(solution.split("\\boxed{")[1].rstrip("}"))
        assert answer == sum(d * 10**i for i, d in enumerate(digits))
        wrong += answer != a + b
    assert abs(slipped / columns - 0.3) < 0.02
    assert 0.4 < wrong / len(rows) < 0.6  # about 1 - 0.7^2 over two-digit sums


def test_bad_rows_name_file_row_and_field(tmp_path):
    """Rows are counted one way in every message: the 1-based line of the .jsonl file."""
    path = _write(tmp_path, [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?"}])
    with pytest.raises(DatasetError, match=r"set.jsonl: row 2: field 'answer' missing"):
        load_prompts(DatasetConfig(source=path, task="math"))
    path = _write(tmp_path, ['{"prompt": "x", "answer": 1}', "{not json"], "broken.jsonl")
    with pytest.raises(DatasetError, match=r"broken.jsonl: row 2: not valid JSON"):
        load_prompts(DatasetConfig(source=path, task="math"))
    path = _write(tmp_path, [{"prompt": "write f", "tests": "[oops"}], "code.jsonl")
    with pytest.raises(DatasetError, match=r"code.jsonl: row 1: field 'tests' is a string but not JSON"):
        load_prompts(DatasetConfig(source=path, task="code"))


def test_files_that_cannot_be_read_as_data_name_the_file(tmp_path):
    """A directory with a data file's name, a file that is not parquet, a line that is not UTF-8: one DatasetError
    naming the file (and row), not a traceback from the reader."""
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DatasetError, match=r"dir.jsonl: is a directory, not a data file"):
        load_prompts(DatasetConfig(source=str(tmp_path / "dir.jsonl"), task="math"))
    (tmp_path / "fake.parquet").write_text("a,b\n1,2\n")
    with pytest.raises(DatasetError, match=r"fake.parquet: not a readable parquet file"):
        load_prompts(DatasetConfig(source=str(tmp_path / "fake.parquet"), task="math"))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "1+1?", "answer": "2"}\n{"prompt": "caf\xe9?", "answer": "3"}\n')
    with pytest.raises(DatasetError, match=r"latin.jsonl: row 2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_prompts(DatasetConfig(source=str(latin), task="math"))
    prompts, stats = load_prompts(DatasetConfig(source=str(latin), task="math"), bad_rows="skip")
    assert [p.answer for p in prompts] == ["2"] and stats.skipped == 1


def test_bad_rows_can_be_skipped_and_counted(tmp_path):
    rows = [{"problem": "1+1?", "answer": 2}, {"problem": ""}, {"question": "3+3?", "solution": "6"}, "[1, 2]"]
    prompts, stats = load_prompts(DatasetConfig(source=_write(tmp_path, rows), task="math"), bad_rows="skip")
    assert [p.answer for p in prompts] == ["2", "6"]
    assert stats.rows == 4 and stats.skipped == 2 and "row 2" in stats.errors[0]


def test_code_rows_accept_deepcoder_style_tests(tmp_path):
    tests = {"inputs": ["1\n"], "outputs": ["2\n"]}
    rows = [{"problem": "add one", "tests": json.dumps(tests), "id": "p1"}]
    prompts, _ = load_prompts(DatasetConfig(source=_write(tmp_path, rows), task="code"))
    assert prompts[0].tests == tests and prompts[0].id == "p1"


def test_code_rows_accept_deepcoder_case_lists_and_name_bad_tests(tmp_path):
    stdio = [{"input": "1\n", "output": "2\n", "testtype": "stdin"}, {"input": "5\n", "output": "6\n"}]
    functional = [{"input": "[1, 2]", "output": "3", "testtype": "functional", "metadata": {"func_name": "add"}}]
    rows = [
        {"problem": "add one", "tests": json.dumps(stdio)},
        {"problem": "add", "tests": functional},
        {"problem": "broken", "tests": [{"input": "1"}]},
        {"problem": "uneven", "tests": {"inputs": ["1"], "outputs": []}},
    ]
    path = _write(tmp_path, rows, "deepcoder.jsonl")
    prompts, stats = load_prompts(DatasetConfig(source=path, task="code"), bad_rows="skip")
    # LiveCodeBench's stdin cases: numbers in the output compared as decimals, as its grader does
    assert prompts[0].tests == {"inputs": ["1\n", "5\n"], "outputs": ["2\n", "6\n"], "compare": "decimal"}
    assert prompts[1].tests == {"inputs": [[[1, 2]]], "outputs": [3], "fn_name": "add"}  # JSON text decoded
    assert stats.skipped == 2
    assert "deepcoder.jsonl: row 3: field 'tests'" in stats.errors[0] and "'input'" in stats.errors[0]
    assert "row 4: field 'tests': code tests need as many outputs as inputs" in stats.errors[1]


def test_parquet_rows_load(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "math.parquet"
    pq.write_table(pa.table({"problem": ["1+1?", "2+3?"], "answer": ["2", "5"], "id": ["a", "b"]}), path)
    prompts, _ = load_prompts(DatasetConfig(source=str(path), task="math"))
    assert [(p.id, p.answer) for p in prompts] == [("a", "2"), ("b", "5")]


def test_validation_split_is_deterministic_and_disjoint():
    cfg = DataConfig(datasets=[DatasetConfig(source="synthetic:arithmetic")], val_prompts=50, seed=3)
    a, b = load_splits(cfg), load_splits(cfg)
    assert [p.id for p in a.val["math"]] == [p.id for p in b.val["math"]]
    assert len(a.val["math"]) == 50
    assert not {p.id for p in a.val["math"]} & {p.id for p in a.train["synthetic:arithmetic"]}
    other = load_splits(DataConfig(datasets=cfg.datasets, val_prompts=50, seed=4))
    assert [p.id for p in other.val["math"]] != [p.id for p in a.val["math"]]


def test_the_warm_up_prompts_are_the_same_for_every_validation_size_up_to_the_holdout_and_never_validation():
    """Runs that differ only in `val_prompts` (8, 16, 256) warm up on the same prompts, so they start from the same
    policy; none of those prompts is in any of their validations; a larger validation keeps its own out too."""
    from megatron_rl.data.datasets import WARMUP_HOLDOUT

    datasets = [DatasetConfig(source="synthetic:arithmetic")]
    splits = {n: load_splits(DataConfig(datasets=datasets, val_prompts=n, seed=3)) for n in (8, 16, 256, 400)}
    key = "synthetic:arithmetic"
    warm = [p.id for p in splits[8].warmup[key]]
    assert warm == [p.id for p in splits[16].warmup[key]] == [p.id for p in splits[256].warmup[key]]
    assert warm == [p.id for p in splits[256].train[key]]  # the recipe's own size: its whole training split
    assert len(warm) == len(splits[8].train[key]) - (WARMUP_HOLDOUT - 8)
    for split in splits.values():
        assert not set(p.id for p in split.warmup[key]) & {p.id for p in split.val["math"]}
        assert set(p.id for p in split.warmup[key]) <= {p.id for p in split.train[key]}
    assert [p.id for p in splits[400].warmup[key]] == [p.id for p in splits[400].train[key]]


def _sampler(train, seed=0, threshold=0.9):
    return CurriculumSampler(train, {k: 1.0 for k in train}, seed, NoPositiveResampling(threshold))


def test_sampler_epochs_skip_retired_prompts_and_resume_exactly():
    train = load_splits(
        DataConfig(datasets=[DatasetConfig(source="synthetic:arithmetic", limit=40)], val_prompts=0)
    ).train
    sampler = _sampler(train)
    drawn = [sampler.next_prompt() for _ in range(40)]
    for prompt in drawn:
        sampler.done(prompt)  # every group trained on before the checkpoint
    first_epoch = [p.id for p in drawn]
    assert len(set(first_epoch)) == 40
    sampler.no_positive.update(first_epoch[0], [True] * 10)
    state = json.loads(json.dumps(sampler.state_dict()))
    rest = [sampler.next_prompt().id for _ in range(60)]
    assert first_epoch[0] not in rest and sampler.retired_skips >= 1
    resumed = _sampler(train)
    resumed.load_state_dict(state)
    assert [resumed.next_prompt().id for _ in range(60)] == rest


def test_sampler_draws_prompts_not_trained_on_at_the_checkpoint_again_first():
    """A checkpoint taken while groups were generating: a resumed sampler draws those prompts again, in the
    order they were drawn, then continues exactly as the uninterrupted one."""
    train = load_splits(
        DataConfig(datasets=[DatasetConfig(source="synthetic:arithmetic", limit=40)], val_prompts=0)
    ).train
    sampler = _sampler(train)
    drawn = [sampler.next_prompt() for _ in range(10)]
    for prompt in drawn[:3] + drawn[5:8]:  # trained on; drawn[3:5] and drawn[8:] still in flight
        sampler.done(prompt)
    state = json.loads(json.dumps(sampler.state_dict()))
    later = [sampler.next_prompt().id for _ in range(20)]

    resumed = _sampler(train)
    resumed.load_state_dict(state)
    in_flight = [p.id for p in drawn[3:5] + drawn[8:]]
    assert [resumed.next_prompt().id for _ in range(24)] == in_flight + later

    with pytest.raises(ValueError, match=r"outstanding prompt synthetic:arithmetic\[99\]"):
        _sampler(train).load_state_dict({**state, "outstanding": [["synthetic:arithmetic", 99]]})


def test_sampler_mixes_by_weight():
    cfg = DataConfig(datasets=[DatasetConfig(source="synthetic:arithmetic", limit=30)], val_prompts=0)
    math = load_splits(cfg).train["synthetic:arithmetic"]
    train = {"a": math[:15], "b": math[15:]}
    sampler = CurriculumSampler(train, {"a": 3.0, "b": 1.0}, 0, NoPositiveResampling())
    ids_a = {p.id for p in train["a"]}
    share = sum(sampler.next_prompt().id in ids_a for _ in range(2000)) / 2000
    assert 0.70 < share < 0.80


def test_sampler_all_retired_is_a_clear_error():
    train = {
        "s": load_splits(DataConfig(datasets=[DatasetConfig(limit=3)], val_prompts=0)).train["synthetic:arithmetic"]
    }
    sampler = _sampler(train)
    for p in train["s"]:
        sampler.no_positive.update(p.id, [True])
    with pytest.raises(RuntimeError, match="every prompt of s is retired"):
        sampler.next_prompt()


def test_a_row_and_its_dataset_declare_the_tools_its_prompt_may_call(tmp_path):
    rows = [{"prompt": "1+1?", "answer": "2", "tools": ["python"]}, {"prompt": "2+2?", "answer": "4"}]
    path = _write(tmp_path, rows)
    plain = load_splits(DataConfig(datasets=[DatasetConfig(source=path)], val_prompts=0))
    assert sorted(p.tools for p in plain.train[path]) == [(), ("python",)]
    offered = load_splits(DataConfig(datasets=[DatasetConfig(source=path, tools=["python"])], val_prompts=0))
    assert [p.tools for p in offered.train[path]] == [("python",), ("python",)]  # the dataset's, each named once
    assert plain.fingerprints() == plain.fingerprints() != offered.fingerprints()  # what a prompt may call is data
    bad = _write(tmp_path, [{"prompt": "1+1?", "answer": "2", "tools": [3]}], "bad.jsonl")
    with pytest.raises(DatasetError, match=r"bad.jsonl: row 1: field 'tools' must be a list of tool names"):
        load_prompts(DatasetConfig(source=bad), "error")
