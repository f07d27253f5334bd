"""LiveCodeBench's code_generation_lite schema: its prompts and its test-case fields, read as the benchmark writes them.

    lcb_prompt(question_content, starter_code)        the generation prompt (starter code, or stdin/stdout)
    lcb_cases(row["public_test_cases"], where, field) the cases: JSON text, or base64(zlib(pickle(JSON text)))

Shared by the downstream benchmark (data/benchmarks.py) and LiveCodeBench rows used as training data
(data/code_sets.py).
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from typing import Any

from megatron_rl.data.errors import DatasetError

LCB_STDIN = (
    "Read the input from standard input, solve the problem and write the answer to standard output. "
    "Give the whole program in one ```python code block."
)
LCB_STARTER = "Complete the following starter code and give the whole solution in one ```python code block:"


def lcb_prompt(content: str, starter: str) -> str:
    """A LiveCodeBench problem as a prompt: the statement, then the starter code to complete (functional
    problems) or the stdin/stdout instruction, as LiveCodeBench's own generation prompt asks."""
    if starter.strip():
        return f"{content.strip()}\n\n{LCB_STARTER}\n```python\n{starter.rstrip()}\n```"
    return f"{content.strip()}\n\n{LCB_STDIN}"


class _StringsOnly(pickle.Unpickler):
    """Builds strings, numbers and containers; any class or function in the stream is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a class ({module}.{name}) in LiveCodeBench's test data; refused")


def lcb_cases(value: Any, where: str, field_name: str) -> list[dict[str, Any]]:
    """A LiveCodeBench test-case field as a list of cases: JSON text, or base64(zlib(pickle(JSON text)))."""
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise DatasetError(f"{where}: field '{field_name}' must be JSON text, got {type(value).__name__}")
    try:
        cases = json.loads(value)
    except json.JSONDecodeError:
        try:
            raw = zlib.decompress(base64.b64decode(value.encode(), validate=True))
            text = _StringsOnly(io.BytesIO(raw)).load()
            cases = json.loads(text) if isinstance(text, str) else text
        except Exception as exc:  # binascii, zlib, pickle and JSON errors all mean the field does not decode
            raise DatasetError(
                f"{where}: field '{field_name}' is neither JSON nor LiveCodeBench's compressed form "
                f"({type(exc).__name__}: {exc})"
            ) from None
    if not isinstance(cases, list):
        raise DatasetError(f"{where}: field '{field_name}' must hold a list of cases, got {type(cases).__name__}")
    return cases
