"""Public code sets read in their published schemas (rows written here in each schema) and judged end to end in
the real sandboxes: the canonical solution passes, a wrong one fails."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import DatasetConfig, RewardsConfig, SandboxConfig
from megatron_rl.data.datasets import load_prompts
from megatron_rl.rewards.code import code_reward
from megatron_rl.rewards.sandbox import isolation_problem

CFG = RewardsConfig(sandbox=SandboxConfig(wall_time_s=20.0, cpu_time_s=2.0, memory_mb=256, max_output_bytes=1 << 16))

needs_isolation = pytest.mark.skipif(
    isolation_problem(CFG.sandbox) is not None, reason=f"no isolation here: {isolation_problem(CFG.sandbox)}"
)

PROMPT = 'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n'
RIGHT, WRONG = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n"

ROWS = {
    "humaneval": {
        "task_id": "HumanEval/53",
        "prompt": PROMPT,
        "canonical_solution": "    return a + b\n",
        "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(0, 1) == 1\n"
        "    assert candidate(5, 7) == 12\n",
        "entry_point": "add",
    },
    "evalplus-release": {
        "task_id": "HumanEval/53",
        "prompt": PROMPT,
        "canonical_solution": "    return a + b\n",
        "entry_point": "add",
        "base_input": [[0, 1], [5, 7]],
        "plus_input": [[10**30, 1], [-3, 3]],
        "atol": 0,
        "contract": "",
        "test": "",
    },
    "mbpp": {
        "task_id": 2,
        "text": "Write a function to add two numbers.",
        "code": "def add(a, b):\n    return a + b",
        "test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert math.isclose(add(0.1, 0.2), 0.3)"],
        "test_setup_code": "import math",
        "challenge_test_list": [],
    },
    "mbpp-plus": {
        "task_id": 2,
        "prompt": "Write a function to add two numbers.",
        "code": "def add(a, b):\n    return a + b",
        "test_imports": [],
        "test_list": ["assert add(1, 2) == 3"],
        "test": "import numpy as np\n\ndef assertion(out, exp, atol):\n    if out != exp and atol != 0:\n"
        "        assert np.allclose(out, exp, rtol=1e-07, atol=atol)\n    else:\n        assert out == exp\n\n"
        "inputs = [[1, 2], [0.1, 0.2]]\nresults = [3, 0.30000000000000004]\n"
        "for i, (inp, exp) in enumerate(zip(inputs, results)):\n    assertion(add(*inp), exp, 1e-6)\n",
    },
    "livecodebench": {
        "question_title": "add",
        "question_content": "Read a and b, print a + b.",
        "platform": "atcoder",
        "question_id": "abc000_a",
        "contest_date": "2024-01-01T00:00:00",
        "starter_code": "",
        "public_test_cases": json.dumps([{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]),
        "private_test_cases": json.dumps([{"input": "5 7\n", "output": "12\n", "testtype": "stdin"}]),
        "metadata": "{}",
    },
    "apps": {
        "problem_id": 7,
        "question": "Read a and b, print a + b.",
        "input_output": json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}),
        "solutions": "[]",
    },
}
STDIN_RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"
STDIN_WRONG = "a, b = map(int, input().split())\nprint(a - b)\n"


@pytest.fixture
def load(tmp_path):
    def load(row):
        path = tmp_path / "set.jsonl"
        path.write_text(json.dumps(row) + "\n")
        (prompt,), _ = load_prompts(DatasetConfig(source=str(path), task="code"))
        return prompt

    return load


def test_each_schema_becomes_a_prompt_with_tests(load):
    humaneval = load(ROWS["humaneval"])
    assert humaneval.id == "HumanEval/53" and PROMPT.strip() in humaneval.prompt
    assert humaneval.tests["entry_point"] == "add" and humaneval.tests["asserts"][0].endswith("check(add)\n")
    release = load(ROWS["evalplus-release"])
    assert "return a + b" not in release.tests["setup"]  # the reference never reaches the solution's process
    mbpp = load(ROWS["mbpp"])
    assert "assert add(1, 2) == 3" in mbpp.prompt and mbpp.tests["setup"] == "import math"
    assert load(ROWS["livecodebench"]).tests["compare"] == "decimal"
    assert load(ROWS["apps"]).tests["inputs"] == ["1 2\n", "5 7\n"]


@needs_isolation
@pytest.mark.parametrize("schema", list(ROWS))
def test_canonical_solutions_pass_and_wrong_ones_fail(load, schema):
    prompt = load(ROWS[schema])
    right, wrong = (STDIN_RIGHT, STDIN_WRONG) if schema in ("livecodebench", "apps") else (RIGHT, WRONG)
    good = code_reward(f"```python\n{right}```", prompt.tests, CFG)
    bad = code_reward(f"```python\n{wrong}```", prompt.tests, CFG)
    assert (good.passed, bad.passed) == (True, False), (schema, good, bad)
