"""Code test formats: LiveCodeBench's JSON text is decoded once, at conversion; every other expected value
is kept as the value it is; a functional case that is not JSON text is an error naming file, row and case."""

import json

import pytest

from megatron_rl.config import DatasetConfig
from megatron_rl.data.datasets import DatasetError, load_prompts
from megatron_rl.rewards.code import from_case_list, normalise_tests


def _functional(*cases):
    return [{"input": i, "output": o, "testtype": "functional", "metadata": {"func_name": "f"}} for i, o in cases]


def _load(tmp_path, tests_per_row, bad_rows="error"):
    path = tmp_path / "code.jsonl"
    rows = [{"problem": f"problem {i}", "tests": json.dumps(tests)} for i, tests in enumerate(tests_per_row)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return load_prompts(DatasetConfig(source=str(path), task="code"), bad_rows=bad_rows)


def test_functional_cases_are_decoded_once_at_conversion():
    tests = from_case_list(_functional(("[1, 2]\n3", "21"), ('"a"', '"21"'), ("", "null")))
    assert tests == {"fn_name": "f", "inputs": [[[1, 2], 3], ["a"], []], "outputs": [21, "21", None]}
    assert normalise_tests(tests) == tests  # scoring the converted dict decodes nothing again


def test_call_based_values_are_kept_as_they_are():
    # TACO/APPS store values, not JSON text: an expected string that looks like a number stays a string.
    tests = {"fn_name": "f", "inputs": [[1], ["2"]], "outputs": ["21", ["[0, 1]"]]}
    assert normalise_tests(tests) == {"fn_name": "f", "inputs": [[1], ["2"]], "outputs": ["21", ["[0, 1]"]]}


def test_loaded_rows_hold_decoded_values(tmp_path):
    prompts, _ = _load(tmp_path, [_functional(("5", '"21"'), ("6", "22"))])
    assert prompts[0].tests == {"fn_name": "f", "inputs": [[5], [6]], "outputs": ["21", 22]}


@pytest.mark.parametrize(
    ("tests", "message"),
    [
        (_functional(("1", "21"), ("2", "twenty-two")), "case 1: functional 'output' is not JSON text"),
        (_functional(("1", "21"), ("{oops", "22")), "case 1: functional 'input' is not JSON text"),
        (_functional(("1", "21"), ("2", 22)), "case 1: functional 'output' must be JSON text, got int"),
        (_functional(("1", "21"), ([2], "22")), "case 1: functional 'input' must be JSON text, got list"),
        (
            _functional(("1", "21")) + [{"input": "2\n", "output": "22\n", "testtype": "stdin"}],
            "mixes test types ['functional', 'stdin']",
        ),
        ({"fn_name": "f", "inputs": [[1], "2"], "outputs": [21, 22]}, "call-based input 1 must be the list"),
    ],
)
def test_a_malformed_row_is_an_error_naming_file_row_field_and_case(tmp_path, tests, message):
    with pytest.raises(DatasetError) as error:
        _load(tmp_path, [_functional(("1", "21")), tests])
    assert "code.jsonl: row 1: field 'tests': code tests: " in str(error.value)
    assert message in str(error.value)


def test_malformed_rows_can_be_skipped_and_counted(tmp_path):
    prompts, stats = _load(tmp_path, [_functional(("1", "21")), _functional(("1", "x"))], bad_rows="skip")
    assert len(prompts) == 1 and stats.skipped == 1 and "row 1" in stats.errors[0]
