"""Code test formats: LiveCodeBench's JSON text is decoded once, at conversion; every other expected value
is kept as the value it is; a functional case that is not JSON text is an error naming file, row and case."""

import json

import pytest

from megatron_rl.config import DatasetConfig, RewardsConfig
from megatron_rl.data.code_tests import from_case_list, normalise_tests
from megatron_rl.data.datasets import DatasetError, load_prompts
from megatron_rl.rewards import code
from megatron_rl.rewards.sandbox import RunResult


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
    assert "code.jsonl: row 2: field 'tests': code tests: " in str(error.value)  # the second line
    assert message in str(error.value)


def test_malformed_rows_can_be_skipped_and_counted(tmp_path):
    prompts, stats = _load(tmp_path, [_functional(("1", "21")), _functional(("1", "x"))], bad_rows="skip")
    assert len(prompts) == 1 and stats.skipped == 1 and "row 2" in stats.errors[0]


class _ReturningSandbox:
    """Stands in for the sandbox: the harness 'returns' `values`, one result line per case, as it prints them."""

    def __init__(self, values):
        self.values = values

    def run(self, program, stdin=b"", files=None):
        stdout = "".join(json.dumps({"ok": True, "value": value}) + "\n" for value in self.values)
        return RunResult("ok", 0, stdout.encode(), b"", 0.0, 0.0)


@pytest.mark.parametrize(
    ("expected", "returned", "passed"),
    [
        ("21", "21", True),
        ("21", 21, False),  # a string that parses as JSON is still the string
        (21, "21", False),
        ("[0, 1]", [0, 1], False),
        ("null", None, False),
        (["21"], "21", True),  # TACO's one-element list
        ([21], "21", False),
        ([0, 1], [0, 1], True),
    ],
)
def test_call_based_scoring_compares_the_expected_value_as_it_is(monkeypatch, expected, returned, passed):
    # The whole host side of a call-based test (code_reward -> _run_harness -> _matches), without bubblewrap.
    monkeypatch.setattr(code, "get_sandbox", lambda cfg: _ReturningSandbox([returned]))
    tests = {"fn_name": "f", "inputs": [[1]], "outputs": [expected]}
    result = code.code_reward("<think>x</think>\n```python\ndef f(x):\n    pass\n```", tests, RewardsConfig())
    assert result.passed is passed
    assert result.failure == (None if passed else "wrong_answer")
    assert code._matches(returned, expected) is passed
