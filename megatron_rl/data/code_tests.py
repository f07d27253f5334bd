"""Code-test formats: every accepted form of a code prompt's tests, normalised to one dict form and checked.

    normalise_tests([{"input": "1 2", "output": "3"}])   -> {"inputs": ["1 2"], "outputs": ["3"]}

The dict forms (stdin/stdout, call-based, assert-based) are what the code reward scores (rewards/code.py
says how each is run); DeepCoder's per-case lists are converted here, once, when a dataset row is loaded.
"""

from __future__ import annotations

import json
from typing import Any

from megatron_rl.data.assert_tests import check_judged

STDOUT_COMPARES = ("float", "decimal", "lines")
"""How stdin/stdout outputs compare (rewards/code.py `outputs_match`): 'float' (the default: APPS/TACO's rule,
numbers within np.allclose's tolerance), 'decimal' (LiveCodeBench's: numbers equal as decimals), 'lines'
(whitespace-normalised lines equal as text)."""


def from_case_list(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """DeepCoder's per-case lists (LiveCodeBench, Codeforces, PrimeIntellect rows) as the dict form.

    [{"input": "1 2", "output": "3"}, ...]                  -> {"inputs": ["1 2"], "outputs": ["3"]}
    [{"input": "[1, 2]\n3", "output": "[0]", "testtype": "functional",
      "metadata": {"func_name": "f"}}, ...]                 -> {"fn_name": "f", "inputs": [[[1, 2], 3]],
                                                                "outputs": [[0]]}

    Functional cases hold JSON text (LiveCodeBench's format: one argument per input line, one value as
    output), decoded here: `"output": "21"` is the number 21, `"output": "\"21\""` the string "21". A
    functional input or output that is not a string of JSON text raises ValueError naming the case, as
    does a list that mixes test types.
    """
    if not cases or not all(isinstance(case, dict) and "input" in case and "output" in case for case in cases):
        raise ValueError("code tests given as a list need {'input': ..., 'output': ...} cases")
    testtypes = {case["testtype"] for case in cases if case.get("testtype")}
    if len(testtypes) > 1:
        raise ValueError(f"code tests: a case list mixes test types {sorted(map(str, testtypes))}")
    first = cases[0]
    fn_name = first.get("fn_name") or (first.get("metadata") or {}).get("func_name")
    if "functional" in testtypes and not fn_name:
        raise ValueError("code tests: a functional case list needs metadata.func_name")
    if not fn_name:
        tests = {"inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases]}
        if "stdin" in testtypes:  # LiveCodeBench's schema: its grade_stdio compares numbers as decimals
            tests["compare"] = "decimal"
        return tests
    inputs = [_functional_args(case["input"], index) for index, case in enumerate(cases)]
    outputs = [_json(case["output"], index, "output") for index, case in enumerate(cases)]
    return {"fn_name": fn_name, "inputs": inputs, "outputs": outputs}


def normalise_tests(tests: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """Any accepted test format as the dict form, checked; ValueError says what is wrong."""
    if isinstance(tests, list):
        tests = from_case_list(tests)
    if not isinstance(tests, dict):
        raise ValueError(f"code tests must be an object or a list of cases, got {type(tests).__name__}")
    _check_tests(tests)
    return tests


def _check_tests(tests: dict[str, Any]) -> None:
    if "asserts" in tests:
        check_judged(tests)  # run as written in the judge's process: refused only when not Python
        return
    if "inputs" not in tests or "outputs" not in tests:
        raise ValueError(
            f"code tests need 'inputs' and 'outputs' (and 'fn_name' if call-based) or 'asserts'; got {sorted(tests)}"
        )
    if not tests["inputs"] or len(tests["inputs"]) != len(tests["outputs"]):
        counts = f"{len(tests['inputs'])} inputs, {len(tests['outputs'])} outputs"
        raise ValueError(f"code tests need as many outputs as inputs, at least one; got {counts}")
    if tests.get("compare", "float") not in STDOUT_COMPARES:
        raise ValueError(f"code tests: 'compare' must be one of {list(STDOUT_COMPARES)}, got {tests['compare']!r}")
    if tests.get("fn_name"):
        for index, args in enumerate(tests["inputs"]):
            if not isinstance(args, list):
                raise ValueError(
                    f"code tests: call-based input {index} must be the list of arguments, got {type(args).__name__}"
                    " (JSON text, as LiveCodeBench stores it, belongs in a case list with testtype 'functional')"
                )


def _functional_args(text: Any, index: int) -> list[Any]:
    """A functional case's input: one JSON argument per line."""
    if not isinstance(text, str):
        raise ValueError(f"code tests: case {index}: functional 'input' must be JSON text, got {type(text).__name__}")
    return [_json(line, index, "input") for line in text.splitlines() if line.strip()]


def _json(text: Any, index: int, field: str) -> Any:
    if not isinstance(text, str):
        raise ValueError(f"code tests: case {index}: functional '{field}' must be JSON text, got {type(text).__name__}")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"code tests: case {index}: functional '{field}' is not JSON text ({exc}): {text[:80]!r}"
        ) from None
