"""Public code sets in their published schemas, as code prompts: each row converted once, when it is loaded.

    code_row({"task_id": "HumanEval/0", "prompt": "def f(x):\\n    ...", "test": "def check(candidate): ...",
              "entry_point": "f", ...})
    -> {"id": "HumanEval/0", "prompt": "<instruction + the code>", "tests": {"asserts": [test + "check(f)"],
        "setup": <the prompt's code>, "entry_point": "f"}}

- HumanEval (`openai_humaneval`), HumanEval+ (`evalplus/humanevalplus`): prompt, test, entry_point -> judged:
  `test` then `check(<entry_point>)`, as human-eval builds its program; the prompt's code as setup.
- EvalPlus release files (HumanEvalPlus.jsonl, MbppPlus.jsonl): prompt, entry_point, canonical_solution,
  base_input, plus_input, atol -> judged: the reference runs on each input in the judge only, outputs compared
  by EvalPlus's rule (`EVALPLUS_CHECK`).
- MBPP (`mbpp`, full or sanitized): text or prompt, test_list, test_setup_code or test_imports,
  challenge_test_list -> judged, one unit per assert.
- MBPP+ (`evalplus/mbppplus`): prompt, test_list, test_imports, test -> judged, `test` as one unit.
- LiveCodeBench (`livecodebench/code_generation_lite`): question_content, starter_code, public_test_cases,
  private_test_cases, metadata -> stdin/stdout or call-based case lists (data/code_tests.py).
- APPS / TACO (question, input_output) and DeepCoder (problem, tests): read by data/datasets.py's schema as
  they are.

What runs where: a judged test's `setup` runs in the judge's process and, before the completion, in the solution's
(HumanEval's prompt defines helpers such as `poly` that a completion may call); a reference solution
(EvalPlus's canonical_solution) is placed in the judge's test unit only, never in the solution's process, where
the completion could call it. Rows of any other schema are returned unchanged.
"""

from __future__ import annotations

import json
from typing import Any

from megatron_rl.data.livecodebench import lcb_cases, lcb_prompt

CHAT_INSTRUCTION = (
    "Complete the following Python code. Give the whole program, with every import and function it needs, in one "
    "```python code block."
)


def code_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row of a published schema as {"id", "prompt", "tests"}; any other row unchanged. ValueError names a field
    of a recognised schema that is malformed."""
    if isinstance(row.get("entry_point"), str) and ("base_input" in row or "plus_input" in row):
        return _evalplus_release(row)
    if isinstance(row.get("entry_point"), str) and isinstance(row.get("test"), str) and "prompt" in row:
        return _humaneval(row)
    if isinstance(row.get("test_list"), list):
        return _mbpp(row)
    if "question_content" in row and "public_test_cases" in row:
        return _livecodebench(row)
    return row


def _prompt(code: str) -> str:
    return f"{CHAT_INSTRUCTION}\n\n```python\n{code.rstrip()}\n```"


def _humaneval(row: dict[str, Any]) -> dict[str, Any]:
    entry = row["entry_point"]
    # As human-eval's harness builds its program: the test, then `check(<entry point>)`.
    tests = {"asserts": [f"{row['test']}\n\ncheck({entry})\n"], "setup": str(row["prompt"]), "entry_point": entry}
    return {"id": str(row.get("task_id", entry)), "prompt": _prompt(str(row["prompt"])), "tests": tests}


def _mbpp(row: dict[str, Any]) -> dict[str, Any]:
    asserts = [str(t) for t in row["test_list"]]
    text = str(row.get("text") or row.get("prompt") or "")
    setup = "\n".join([str(row.get("test_setup_code") or ""), *map(str, row.get("test_imports") or [])])
    if isinstance(row.get("test"), str) and row["test"].strip():  # MBPP+: one program with its own inputs
        units = [row["test"]]
    else:
        units = asserts + [str(t) for t in row.get("challenge_test_list") or []]
    # MBPP's prompt shows the tests, which name the function to write (as the MBPP paper prompts).
    prompt = f"{text.strip()}\nYour code should pass these tests:\n\n" + "\n".join(asserts[:3])
    prompt += "\n\nGive the whole program in one ```python code block."
    return {"id": str(row.get("task_id", "")), "prompt": prompt, "tests": {"asserts": units, "setup": setup.strip()}}


def _livecodebench(row: dict[str, Any]) -> dict[str, Any]:
    where = f"livecodebench {row.get('question_id', '')}"
    cases = lcb_cases(row["public_test_cases"], where, "public_test_cases")
    if row.get("private_test_cases"):
        cases = cases + lcb_cases(row["private_test_cases"], where, "private_test_cases")
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata) if metadata.strip() else {}
    if metadata.get("func_name"):
        cases = [{**case, "metadata": {"func_name": metadata["func_name"]}} for case in cases]
    prompt = lcb_prompt(str(row["question_content"]), str(row.get("starter_code") or ""))
    return {"id": str(row.get("question_id", "")), "prompt": prompt, "tests": cases}


def _evalplus_release(row: dict[str, Any]) -> dict[str, Any]:
    """EvalPlus's release rows store inputs, not outputs: the judge runs the reference on each input (in its own
    process only) and compares the candidate's output by EvalPlus's rule (`EVALPLUS_CHECK`)."""
    entry = row["entry_point"]
    inputs = list(row.get("base_input") or []) + list(row.get("plus_input") or [])
    if not inputs:
        raise ValueError("EvalPlus row: 'base_input' and 'plus_input' are empty")
    reference = f"{row['prompt']}\n{row['canonical_solution']}"
    unit = (
        f"{EVALPLUS_CHECK}\n"
        f"_reference = {{}}\nexec({reference!r}, _reference)\n"
        f"_evalplus_check({entry}, _reference[{entry!r}], __import__('json').loads({json.dumps(inputs)!r}), "
        f"{float(row.get('atol') or 0)!r}, {entry!r})\n"
    )
    tests = {"asserts": [unit], "setup": str(row["prompt"]), "entry_point": entry}
    return {"id": str(row.get("task_id", entry)), "prompt": _prompt(str(row["prompt"])), "tests": tests}


# EvalPlus's comparison (evalplus/eval/__init__.py `unsafe_execute`): equal, or, where the expected value is a
# float (or a list/tuple of floats) or the row sets `atol`, within np.allclose(rtol=1e-7, atol) (atol 1e-6 when
# the row has none); HumanEval/32's `find_zero` is checked by evaluating the polynomial at the answer, as
# EvalPlus's special oracle does. Runs in the judge's process.
EVALPLUS_CHECK = """
import copy as _copy, math as _math

def _evalplus_floats(x):
    return isinstance(x, float) or isinstance(x, (list, tuple)) and all(isinstance(i, float) for i in x)

def _evalplus_close(out, exp, atol):
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    exps = list(exp) if isinstance(exp, (list, tuple)) else [exp]
    if len(outs) != len(exps):
        return False
    for o, e in zip(outs, exps):
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not isinstance(e, (int, float)):
            return False
        if _math.isnan(e) and _math.isnan(o):
            continue
        if not abs(o - e) <= atol + 1e-7 * abs(e):
            return False
    return True

def _evalplus_check(candidate, reference, inputs, atol, entry):
    for inp in inputs:
        exp = reference(*_copy.deepcopy(inp))
        out = candidate(*_copy.deepcopy(inp))
        if entry == "find_zero":
            xs = inp[0]
            assert abs(sum(c * _math.pow(out, i) for i, c in enumerate(xs))) <= max(atol, 1e-6)
            continue
        if out == exp:
            continue
        tolerance = 1e-6 if atol == 0 and _evalplus_floats(exp) else atol
        assert tolerance != 0 and _evalplus_close(out, exp, tolerance), (inp, out, exp)
"""
