"""Code reward: the completion's final program, run against the task's tests in the sandbox.

    "<think>...</think> ```python\\nn = int(input())\\nprint(3 * n + 4)\\n```"  +  tests  ->  RewardResult

The program is the last fenced block after the thinking part (rewards/math.py `answer_part`). Three test
formats, all a dict in `Prompt.tests` (data/datasets.py):

- stdin/stdout (APPS/TACO/DeepCoder `input_output`): {"inputs": ["5\\n", ...], "outputs": ["19\\n", ...]}.
  One sandbox run per case; outputs are compared as whitespace-normalised lines (each line's runs of
  whitespace collapsed, leading/trailing blank lines ignored), as code-RL graders do.
- call-based: {"fn_name": "f", "inputs": [[arg, ...], ...], "outputs": [value, ...]} (APPS/TACO): each
  input is the argument list and each output the value itself, compared as it is (an expected string
  "21" is the string, never the number). The function is `f` at top level, or a method of
  `class Solution` (LeetCode style). An output wrapped in a one-element list also matches (TACO stores
  them so). All cases run in one sandbox run; only the inputs enter the sandbox, the returned values are
  compared on the host (after a JSON round trip: tuples read as lists).
- assert-based: {"asserts": ["assert f(1) == 2", ...]}: each statement is split into probes (`f(1)`), which
  one sandbox run evaluates in the program's namespace, and the rest (`== 2`), which the host evaluates on the
  probes' values (data/assert_tests.py). Neither the statements nor their expected values enter the sandbox.

Nothing the sandbox reports is a verdict. Returned values cross as tagged plain data (rewards/values.py) that the
host decodes into builtin types only, and the host compares them with expected values the sandbox never sees;
stdin/stdout outputs are compared on the host too. So a program that forges the harness's report (its result
channel, an early exit with a fabricated report, rewritten globals or builtins) or returns an object whose `==`
always answers True can only make the host compare other values, and passes only with the right ones.

DeepCoder's per-case lists ([{"input", "output", "testtype", "metadata": {"func_name"}}, ...]) are
converted to these forms once, when the dataset row is loaded (data/code_tests.py). Their functional
(call-based) cases are LiveCodeBench's, whose inputs (one argument per line) and outputs are JSON text:
that text is decoded there, and a case that is not JSON text is an error naming the case. JSON text is
decoded nowhere else.

Reward: `cfg.correct` if every test passes, else `cfg.incorrect`; with `code_partial_credit` it is
interpolated by the fraction of tests passed. The failure reason is that of the first failing test:
'no_code', 'compile_error', 'wrong_answer', 'timeout', 'memory', 'crash', 'output_limit'.
Without partial credit, the first failing stdin/stdout case ends the evaluation.

Synchronous (it blocks on the sandbox pool), so call it from a reward worker process (rewards/workers.py).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from megatron_rl.config import RewardsConfig
from megatron_rl.data.assert_tests import plan_asserts
from megatron_rl.data.code_tests import normalise_tests
from megatron_rl.rewards.math import RewardResult, answer_part
from megatron_rl.rewards.sandbox import EXIT_COMPILE_ERROR, EXIT_MEMORY, RunResult, get_sandbox
from megatron_rl.rewards.values import ENCODE_SOURCE, decode_value

FAILURES = ("no_code", "compile_error", "wrong_answer", "timeout", "memory", "crash", "output_limit")

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)

# Runs in the sandbox next to solution.py and cases.json; writes one JSON line per case or probe to the original
# stdout, with the solution's own prints sent to /dev/null. Nothing it writes is a verdict: a call's return
# value or a probe's value, as tagged plain data (rewards/values.py), which the host compares with what it alone
# knows. A solution that rewrites this harness, its channel or the encoder can only report other values.
HARNESS = (
    f"""
import json, os, sys
COMPILE_ERROR, MEMORY = {EXIT_COMPILE_ERROR}, {EXIT_MEMORY}
"""
    + ENCODE_SOURCE
    + r"""
def main():
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "cases.json")) as f:
        spec = json.load(f)
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
    if spec["kind"] == "call":
        fn = namespace.get(spec["fn_name"])
        if fn is None and "Solution" in namespace:
            fn = getattr(namespace["Solution"](), spec["fn_name"], None)
        if fn is None:
            raise NameError("no function or Solution method named " + spec["fn_name"])
    for case in spec["cases"]:
        try:
            if spec["kind"] == "call":
                value = fn(*case)
            else:  # a probe: an expression of the test, evaluated in the solution's namespace
                value = eval(compile(case["expr"], "<probe>", "eval"), namespace)
                if case["assign"]:
                    namespace[case["assign"]] = value
            line = json.dumps({"ok": True, "value": encode_value(value)})
        except MemoryError:
            os._exit(MEMORY)
        except Exception as exc:
            line = json.dumps({"ok": False, "error": type(exc).__name__})
        results.write(line + "\n")
        results.flush()

main()
"""
)


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
        outcomes = _run_asserts(program, list(tests["asserts"]), cfg)
    elif "fn_name" in tests and tests["fn_name"]:
        outcomes = _run_harness(program, "call", tests["inputs"], tests["outputs"], cfg, fn_name=tests["fn_name"])
    else:
        outcomes = _run_stdio(program, [_text(x) for x in tests["inputs"]], [_text(y) for y in tests["outputs"]], cfg)
    failures = [outcome for outcome in outcomes if outcome is not None]
    if not failures:
        return RewardResult(cfg.correct, True)
    if cfg.code_partial_credit:
        passed = outcomes.count(None) / len(outcomes)
        return RewardResult(cfg.incorrect + (cfg.correct - cfg.incorrect) * passed, False, failures[0])
    return RewardResult(cfg.incorrect, False, failures[0])


def code_time_bound_s(tests: dict[str, Any] | list[dict[str, Any]], cfg: RewardsConfig) -> float:
    """The longest `code_reward` takes on these tests without a hang: its sandbox runs (one per stdin/stdout
    case, else one), in waves of `sandbox.workers`, each bounded by the sandbox's wall time plus a second to
    start and kill it."""
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
        if got == expected:
            return True
        # TACO wraps call-based outputs in a one-element list.
        return isinstance(expected, list) and len(expected) == 1 and got == expected[0]
    except TypeError:  # a value that is not plain data (data/assert_tests.py Opaque) equals nothing
        return False


def _run_stdio(program: str, inputs: list[str], outputs: list[str], cfg: RewardsConfig) -> list[str | None]:
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
        if outcome is None and normalise_output(result.stdout.decode(errors="replace")) != normalise_output(expected):
            outcome = "wrong_answer"
        outcomes.append(outcome)
        if outcome is not None and not cfg.code_partial_credit:
            for pending in futures[index + 1 :]:
                pending.cancel()
            break
    return outcomes


def _run_asserts(program: str, statements: list[str], cfg: RewardsConfig) -> list[str | None]:
    """Assert-based tests: their probes evaluated in one sandbox run, each statement judged here on the values
    (data/assert_tests.py); the statements themselves, and the values they expect, never enter the sandbox."""
    plan = plan_asserts(statements)
    cases = [{"expr": step.expr, "assign": step.assign} for step in plan.steps]
    records, ended = _harness_records(program, "probe", cases, cfg)
    return plan.judge(records, missing=ended)


def _run_harness(
    program: str, kind: str, cases: list[Any], expected: list[Any], cfg: RewardsConfig, fn_name: str = ""
) -> list[str | None]:
    """Call-based tests: all cases in one sandbox run, each returned value compared here with the expected one; a
    case without a result line failed the way the run ended."""
    records, ended = _harness_records(program, kind, cases, cfg, fn_name)
    outcomes: list[str | None] = []
    for index, want in enumerate(expected):
        if index >= len(records):
            outcomes.append(ended)
            continue
        ok, value = records[index]
        if not ok:
            outcomes.append("wrong_answer" if value == "AssertionError" else "crash")
        elif not _matches(_as_json_data(value), want):
            outcomes.append("wrong_answer")
        else:
            outcomes.append(None)
    return outcomes


def _harness_records(
    program: str, kind: str, cases: list[Any], cfg: RewardsConfig, fn_name: str = ""
) -> tuple[list[tuple[bool, Any]], str]:
    """(ok, decoded value or error name) per line the harness wrote, and how the run ended for the cases it did
    not report. A line that is not a well-formed record ends the records there (as a crash)."""
    spec = {"kind": kind, "fn_name": fn_name, "cases": cases}
    result = get_sandbox(cfg.sandbox).run(HARNESS, files={"solution.py": program, "cases.json": json.dumps(spec)})
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
            records.append((True, decode_value(record["value"])))
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
