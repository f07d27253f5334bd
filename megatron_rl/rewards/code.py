"""Code reward: the completion's final program, run against the task's tests in the sandbox.

    "<think>...</think> ```python\\nn = int(input())\\nprint(3 * n + 4)\\n```"  +  tests  ->  RewardResult

The program is the last fenced block after the thinking part (rewards/math.py `answer_part`). Three test
formats, all a dict in `Prompt.tests` (data/datasets.py):

- stdin/stdout (APPS/TACO/DeepCoder `input_output`): {"inputs": ["5\\n", ...], "outputs": ["19\\n", ...]}.
  One sandbox run per case; outputs are compared on the host line by line after whitespace normalisation
  (each line's runs of whitespace collapsed, leading/trailing blank lines ignored), and where a line differs,
  token by token under the dataset's rule `compare` (`outputs_match`): 'float' (default; APPS/TACO's testing
  util compares numbers with np.allclose, rtol 1e-5, atol 1e-8; integers exactly), 'decimal' (LiveCodeBench's
  grade_stdio: numbers equal as Decimals) or 'lines' (text only).
- call-based: {"fn_name": "f", "inputs": [[arg, ...], ...], "outputs": [value, ...]} (APPS/TACO): each
  input is the argument list and each output the value itself, compared as it is (an expected string
  "21" is the string, never the number). The function is `f` at top level, or a method of
  `class Solution` (LeetCode style). An output wrapped in a one-element list also matches (TACO stores
  them so). All cases run in one sandbox run; only the inputs enter the sandbox, the returned values are
  compared on the host (after a JSON round trip: tuples read as lists; dicts whose keys are all digit strings,
  as JSON stores int keys, read with int keys, as APPS's testing util does; floats within EvalPlus's atol 1e-6).
- judged (assert-based and test programs): {"asserts": [unit, ...], "setup": ..., "entry_point": ...}
  (data/assert_tests.py): the test program runs as written in a judge process of its own, the solution in
  another, and the judge alone decides each unit (rewards/judge.py). HumanEval, MBPP and EvalPlus rows are
  converted to it when loaded (data/code_sets.py).

Nothing the solution's process reports is a verdict. For stdin/stdout and call-based tests the host compares
what it printed or returned (tagged plain data, rewards/values.py, decoded into builtin types only) with
expected values that never enter its sandbox; for judged tests the verdict comes from the judge's process, into
which only plain values of the solution's cross. So a program that forges its harness's report (its result
channel, an early exit with a fabricated report, rewritten globals or builtins) or returns an object whose `==`
always answers True can only hand over other values, and passes only with the right ones.

DeepCoder's per-case lists ([{"input", "output", "testtype", "metadata": {"func_name"}}, ...]) are
converted to these forms once, when the dataset row is loaded (data/code_tests.py). Their functional
(call-based) cases are LiveCodeBench's, whose inputs (one argument per line) and outputs are JSON text:
that text is decoded there, and a case that is not JSON text is an error naming the case. JSON text is
decoded nowhere else.

Reward: `cfg.correct` if every test passes, else `cfg.incorrect`; with `code_partial_credit` it is
interpolated by the fraction of tests (cases, or judged units) passed. The failure reason is that of the first
failing test: 'no_code', 'compile_error', 'wrong_answer', 'timeout', 'memory', 'crash', 'output_limit'.
Without partial credit, the first failing stdin/stdout case ends the evaluation.

Synchronous (it blocks on the sandbox pool), so call it from a reward worker process (rewards/workers.py).
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from megatron_rl.config import RewardsConfig
from megatron_rl.data.code_tests import normalise_tests
from megatron_rl.rewards.judge import judge, value_limits
from megatron_rl.rewards.math import RewardResult, answer_part
from megatron_rl.rewards.sandbox import EXIT_COMPILE_ERROR, EXIT_MEMORY, RunResult, get_sandbox
from megatron_rl.rewards.values import Limits, ValueLimit, decode, encode

FAILURES = ("no_code", "compile_error", "wrong_answer", "timeout", "memory", "crash", "output_limit")

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)

# Runs in the sandbox next to solution.py, cases.json and values.py; writes one JSON line per case to the original
# stdout, with the solution's own prints sent to /dev/null. Nothing it writes is a verdict: a call's return value,
# as tagged plain data (rewards/values.py), which the host compares with what it alone knows. A solution that
# rewrites this harness, its channel or the encoder can only report other values.
HARNESS = (
    f"""
import json, os, sys
import values
COMPILE_ERROR, MEMORY = {EXIT_COMPILE_ERROR}, {EXIT_MEMORY}
"""
    + r"""
def opaque(obj):
    return {"t": "handle", "v": 0, "type": type(obj).__name__}

def main():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "cases.json")) as f:
        spec = json.load(f)
    limits = values.Limits(**spec["limits"])
    results = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    with open(os.path.join(here, "solution.py"), "rb") as f:
        source = f.read()
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        sys.stderr.write("%s: %s\n" % (type(exc).__name__, exc))
        sys.stderr.flush()
        os._exit(COMPILE_ERROR)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except MemoryError:
        os._exit(MEMORY)
    fn = namespace.get(spec["fn_name"])
    if fn is None and "Solution" in namespace:
        fn = getattr(namespace["Solution"](), spec["fn_name"], None)
    if fn is None:
        raise NameError("no function or Solution method named " + spec["fn_name"])
    for case in spec["cases"]:
        try:
            line = json.dumps({"ok": True, "value": values.encode(fn(*values.decode(case, limits)), limits, opaque)})
        except MemoryError:
            os._exit(MEMORY)
        except values.ValueLimit:
            line = json.dumps({"ok": False, "error": "ValueLimit"})
        except Exception as exc:
            line = json.dumps({"ok": False, "error": type(exc).__name__})
        results.write(line + "\n")
        results.flush()

main()
"""
)
_VALUES_SOURCE = (Path(__file__).parent / "values.py").read_text()


def extract_program(completion: str) -> str | None:
    """The last fenced code block after the thinking part, or None if there is none."""
    final = answer_part(completion)
    if final is None:
        return None
    blocks = _FENCE.findall(final)
    if not blocks or not blocks[-1].strip():
        return None
    return blocks[-1]


def normalise_output(text: str) -> list[str]:
    """Lines with whitespace runs collapsed; leading and trailing blank lines dropped."""
    return [" ".join(line.split()) for line in text.strip().splitlines()]


def code_reward(completion: str, tests: dict[str, Any] | list[dict[str, Any]], cfg: RewardsConfig) -> RewardResult:
    tests = normalise_tests(tests)
    program = extract_program(completion)
    if program is None:
        return RewardResult(cfg.incorrect, False, "no_code")
    if "asserts" in tests:
        outcomes = judge(program, tests, cfg.sandbox)
    elif "fn_name" in tests and tests["fn_name"]:
        outcomes = _run_harness(program, tests["inputs"], tests["outputs"], cfg, fn_name=tests["fn_name"])
    else:
        inputs, outputs = [_text(x) for x in tests["inputs"]], [_text(y) for y in tests["outputs"]]
        outcomes = _run_stdio(program, inputs, outputs, tests.get("compare", "float"), cfg)
    failures = [outcome for outcome in outcomes if outcome is not None]
    if not failures:
        return RewardResult(cfg.correct, True)
    if cfg.code_partial_credit:
        passed = outcomes.count(None) / len(outcomes)
        return RewardResult(cfg.incorrect + (cfg.correct - cfg.incorrect) * passed, False, failures[0])
    return RewardResult(cfg.incorrect, False, failures[0])


def code_time_bound_s(tests: dict[str, Any] | list[dict[str, Any]], cfg: RewardsConfig) -> float:
    """The longest `code_reward` takes on these tests without a hang: its sandbox runs (one per stdin/stdout
    case, else one: a judged test's two processes run side by side under one wall time), in waves of
    `sandbox.workers`, each bounded by the sandbox's wall time plus a second to start and kill it."""
    if isinstance(tests, list):
        runs = len(tests)  # at most one run per case
    elif tests.get("asserts") or tests.get("fn_name"):
        runs = 1
    else:
        runs = len(tests.get("inputs") or ())
    return math.ceil(max(runs, 1) / cfg.sandbox.workers) * (cfg.sandbox.wall_time_s + 1.0)


def _text(value: Any) -> str:
    """A stdin/stdout case as text: some datasets store a case as a list of lines."""
    return "\n".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _matches(got: Any, expected: Any) -> bool:
    try:
        if _equal(got, expected):
            return True
        # TACO wraps call-based outputs in a one-element list.
        return isinstance(expected, list) and len(expected) == 1 and _equal(got, expected[0])
    except TypeError:  # a value that is not plain data (rewards/values.py Opaque) equals nothing
        return False


def _equal(got: Any, expected: Any) -> bool:
    if got == expected:
        return True
    if isinstance(expected, dict) and isinstance(got, dict):
        # JSON stores int keys as text: APPS's testing util reads such dicts back with int keys.
        return _int_keys(got) == _int_keys(expected)
    # EvalPlus: an expected float (or flat list of floats) matches within atol 1e-6 (rtol 1e-7, np.allclose).
    if _floats(expected) and isinstance(got, float | int | list) and not isinstance(got, bool):
        pairs = list(zip(got, expected, strict=False)) if isinstance(got, list) else [(got, expected)]
        if isinstance(got, list) != isinstance(expected, list) or (isinstance(got, list) and len(got) != len(expected)):
            return False
        return all(_close(g, e, 1e-7, 1e-6) for g, e in pairs)
    return False


def _floats(value: Any) -> bool:
    if isinstance(value, float):
        return True
    return isinstance(value, list) and bool(value) and all(isinstance(v, float) for v in value)


def _close(got: Any, expected: float, rtol: float, atol: float) -> bool:
    if isinstance(got, bool) or not isinstance(got, int | float) or math.isnan(expected):
        return False
    return abs(got - expected) <= atol + rtol * abs(expected)  # NaN compares False


def _int_keys(value: dict) -> dict:
    if value and all(isinstance(k, str) and k.lstrip("-").isdigit() for k in value):
        return {int(k): v for k, v in value.items()}
    return value


def outputs_match(got: str, expected: str, compare: str = "float") -> bool:
    """Whether a program's stdout matches the expected output under the dataset's rule (module docstring)."""
    got_lines, expected_lines = normalise_output(got), normalise_output(expected)
    if got_lines == expected_lines:
        return True
    if compare == "lines" or len(got_lines) != len(expected_lines):
        return False
    for got_line, expected_line in zip(got_lines, expected_lines, strict=True):
        if got_line == expected_line:
            continue
        got_tokens, expected_tokens = got_line.split(), expected_line.split()
        if len(got_tokens) != len(expected_tokens):
            return False
        if not all(_token_match(g, e, compare) for g, e in zip(got_tokens, expected_tokens, strict=True)):
            return False
    return True


def _token_match(got: str, expected: str, compare: str) -> bool:
    if got == expected:
        return True
    if compare == "decimal":  # LiveCodeBench: Decimal("1.50") == Decimal("1.5"); never a tolerance
        try:
            return Decimal(got) == Decimal(expected)
        except InvalidOperation:
            return False
    try:  # APPS/TACO: integers exactly (np.allclose would round big ones), other numbers within allclose
        return int(got) == int(expected)
    except ValueError:
        pass
    try:
        a, b = float(got), float(expected)
    except ValueError:
        return False
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= 1e-8 + 1e-5 * abs(b)


def _run_stdio(
    program: str, inputs: list[str], outputs: list[str], compare: str, cfg: RewardsConfig
) -> list[str | None]:
    """One sandbox run per case, concurrently on the pool; None for a pass, else the failure reason.

    Without partial credit the first failure decides: the cases not started yet are cancelled and the
    ones running are not waited for (they finish within their own limits).
    """
    sandbox = get_sandbox(cfg.sandbox)
    futures = [sandbox.submit(program, stdin.encode()) for stdin in inputs]
    outcomes: list[str | None] = []
    for index, (future, expected) in enumerate(zip(futures, outputs, strict=True)):
        result = future.result()
        outcome = _failure(result)
        if outcome is None and not outputs_match(result.stdout.decode(errors="replace"), expected, compare):
            outcome = "wrong_answer"
        outcomes.append(outcome)
        if outcome is not None and not cfg.code_partial_credit:
            for pending in futures[index + 1 :]:
                pending.cancel()
            break
    return outcomes


def _run_harness(
    program: str, cases: list[Any], expected: list[Any], cfg: RewardsConfig, fn_name: str
) -> list[str | None]:
    """Call-based tests: all cases in one sandbox run, each returned value compared here with the expected one; a
    case without a result line failed the way the run ended."""
    records, ended = _harness_records(program, [_int_keyed_args(case) for case in cases], cfg, fn_name)
    outcomes: list[str | None] = []
    for index, want in enumerate(expected):
        if index >= len(records):
            outcomes.append(ended)
            continue
        ok, value = records[index]
        if not ok:
            reasons = {"AssertionError": "wrong_answer", "ValueLimit": "output_limit"}
            outcomes.append(reasons.get(value, "crash"))
        elif not _matches(_as_json_data(value), want):
            outcomes.append("wrong_answer")
        else:
            outcomes.append(None)
    return outcomes


def _int_keyed_args(args: list[Any]) -> list[Any]:
    """APPS's testing util reads a dict argument whose keys are all digit strings with int keys (JSON's text)."""
    return [_int_keys(arg) if isinstance(arg, dict) else arg for arg in args]


def _harness_records(
    program: str, cases: list[Any], cfg: RewardsConfig, fn_name: str
) -> tuple[list[tuple[bool, Any]], str]:
    """(ok, decoded value or error name) per line the harness wrote, and how the run ended for the cases it did
    not report. A line that is not a well-formed record ends the records there (as a crash)."""
    limits = value_limits(cfg.sandbox)
    # Arguments cross tagged (rewards/values.py), so int-keyed dicts and tuples arrive as they are.
    spec = {"fn_name": fn_name, "cases": [encode(case, Limits(**limits)) for case in cases], "limits": limits}
    files = {"solution.py": program, "cases.json": json.dumps(spec), "values.py": _VALUES_SOURCE}
    result = get_sandbox(cfg.sandbox).run(HARNESS, files=files)
    ended = _failure(result) or "crash"  # exited 0 before reporting every case: it cut the harness short
    records: list[tuple[bool, Any]] = []
    for line in result.stdout.decode(errors="replace").splitlines()[: len(cases)]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return records, "crash"
        if not isinstance(record, dict):
            return records, "crash"
        if record.get("ok") is True and "value" in record:
            try:
                records.append((True, decode(record["value"], Limits(**limits))))
            except ValueLimit:
                records.append((False, "ValueLimit"))
        else:
            records.append((False, str(record.get("error", "malformed"))))
    return records, ended


def _as_json_data(value: Any) -> Any:
    """Call-based values as JSON would give them (tuples read as lists), as the expected outputs are stored."""
    if isinstance(value, tuple | list):
        return [_as_json_data(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json_data(v) for k, v in value.items()}
    return value


def _failure(result: RunResult) -> str | None:
    return None if result.status == "ok" else result.status
