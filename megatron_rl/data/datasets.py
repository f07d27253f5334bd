"""Prompt datasets: local jsonl/parquet files, `datasets` hub names, or `synthetic:<task>`.

Each task has a schema (which fields a row must have, and the usual alternative names in public sets:
Polaris' `problem`/`answer`, DeepCoder's `problem`/`tests`). A malformed row raises `DatasetError` naming
the file, the row and the field, or, with `data.bad_rows: skip`, is skipped and counted.

The validation split is drawn deterministically from `data.seed`: the same config gives the same
held-out prompts on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rl.config import DataConfig, DatasetConfig
from megatron_rl.data.code_sets import code_row
from megatron_rl.data.code_tests import normalise_tests
from megatron_rl.data.errors import DatasetError
from megatron_rl.data.synthetic import SYNTHETIC_TASKS


@dataclass
class Prompt:
    id: str
    task: str
    prompt: str
    answer: str | None = None
    """Reference answer (math)."""
    tests: dict[str, Any] | None = None
    """Test cases (code): stdin/stdout, call-based or assert-based; see rewards/code.py. DeepCoder's
    per-case lists are converted to these forms when the row is loaded."""
    tools: tuple[str, ...] = ()
    """Tools the policy may call while answering (a row's `tools` column and its dataset's `tools`; names of
    rollout.tools.enabled): a prompt with tools is sampled as a multi-turn trajectory (rollout/trajectory.py)."""


# For each task: field -> accepted column names, in order of preference.
SCHEMAS: dict[str, dict[str, tuple[str, ...]]] = {
    "math": {"prompt": ("prompt", "problem", "question"), "answer": ("answer", "solution", "final_answer")},
    "code": {"prompt": ("prompt", "problem", "question"), "tests": ("tests", "test_cases", "input_output")},
}


@dataclass
class LoadStats:
    rows: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    """The first few skipped rows' messages, for the log."""


def _field(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    return None


def parse_row(row: Any, task: str, source: str, index: int, line: int | None = None) -> Prompt:
    """Validate one raw row against the task's schema. `index` counts rows from 0 (the default prompt id);
    messages name `line`, the row's 1-based line in a .jsonl file or its 1-based position elsewhere."""
    where = f"{source}: row {index + 1 if line is None else line}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with fields {list(SCHEMAS[task])}, got {type(row).__name__}")
    if task == "code":  # published code sets (HumanEval, MBPP, EvalPlus, LiveCodeBench) read in their own schemas
        try:
            row = code_row(row)
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(f"{where}: {type(exc).__name__}: {exc}") from None
    values = {}
    for name, aliases in SCHEMAS[task].items():
        value = _field(row, aliases)
        if value is None:
            raise DatasetError(f"{where}: field '{name}' missing (accepted column names: {list(aliases)})")
        values[name] = value
    if not isinstance(values["prompt"], str) or not values["prompt"].strip():
        raise DatasetError(f"{where}: field 'prompt' must be a non-empty string")
    if task == "math":
        answer = values["answer"]
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            raise DatasetError(f"{where}: field 'answer' must be a non-empty string or number")
        values["answer"] = answer
    else:
        tests = values["tests"]
        if isinstance(tests, str):
            try:
                tests = json.loads(tests)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: field 'tests' is a string but not JSON: {exc}") from None
        try:
            values["tests"] = normalise_tests(tests)
        except ValueError as exc:
            raise DatasetError(f"{where}: field 'tests': {exc}") from None
    tools = row.get("tools") or []
    if isinstance(tools, str):
        tools = [tools]
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, str) and t for t in tools):
        raise DatasetError(f"{where}: field 'tools' must be a list of tool names, got {tools!r}")
    prompt_id = str(row.get("id", row.get("problem_id", f"{Path(source).stem}-{index}")))
    return Prompt(id=prompt_id, task=task, tools=tuple(tools), **values)


def read_rows(source: str, split: str, subset: str | None = None) -> list[tuple[int, Any]]:
    """(1-based line or position, raw row) of every row of a source."""
    if source.startswith("synthetic:"):
        name = source.removeprefix("synthetic:")
        if name not in SYNTHETIC_TASKS:
            raise DatasetError(f"data.datasets.source: unknown synthetic task {name!r}; known: {list(SYNTHETIC_TASKS)}")
        return list(enumerate(SYNTHETIC_TASKS[name](0), start=1))
    path = Path(source)
    if path.suffix == ".jsonl":
        rows: list[tuple[int, Any]] = []
        for line_no, raw in enumerate(_read_file(path, source).splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                rows.append((line_no, json.loads(raw.decode("utf-8"))))
            except UnicodeDecodeError as exc:  # a row, not the file: `data.bad_rows=skip` can leave it out
                byte = raw[exc.start : exc.start + 1].hex()
                rows.append((line_no, DatasetError(f"{source}: row {line_no}: not UTF-8 text (byte 0x{byte} at "
                                                   f"column {exc.start + 1})")))  # fmt: skip
            except json.JSONDecodeError as exc:
                rows.append((line_no, DatasetError(f"{source}: row {line_no}: not valid JSON: {exc}")))
        return rows
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        _read_file(path, source, probe=True)
        try:
            return list(enumerate(pq.read_table(path).to_pylist(), start=1))
        except (pyarrow.ArrowException, OSError) as exc:
            raise DatasetError(f"{source}: not a readable parquet file ({exc})") from None
    import datasets

    try:
        return list(enumerate(datasets.load_dataset(source, subset, split=split), start=1))
    except Exception as exc:  # the hub client raises many types; name the source and keep the cause
        raise DatasetError(f"{source}: could not load as a `datasets` hub name ({type(exc).__name__}: {exc})") from exc


def _read_file(path: Path, source: str, probe: bool = False) -> bytes:
    """A data file's bytes (`probe`: only that it can be read), or DatasetError saying why not."""
    if path.is_dir():
        raise DatasetError(f"{source}: is a directory, not a data file")
    if not path.exists():
        raise DatasetError(f"{source}: no such file")
    try:
        if probe:
            with path.open("rb") as f:
                f.read(1)
            return b""
        return path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{source}: cannot be read ({exc.strerror or exc})") from None


def load_prompts(cfg: DatasetConfig, bad_rows: str = "error") -> tuple[list[Prompt], LoadStats]:
    """All valid prompts of one dataset config, and how many rows were skipped."""
    stats = LoadStats()
    prompts: list[Prompt] = []
    for index, (line, row) in enumerate(read_rows(cfg.source, cfg.split, cfg.subset)):
        if cfg.limit is not None and len(prompts) >= cfg.limit:
            break
        stats.rows += 1
        try:
            if isinstance(row, DatasetError):
                raise row
            prompts.append(parse_row(row, cfg.task, cfg.key, index, line))
        except DatasetError as exc:
            if bad_rows == "error":
                raise
            stats.skipped += 1
            if len(stats.errors) < 5:
                stats.errors.append(str(exc))
    if not prompts:
        raise DatasetError(f"{cfg.key}: no valid rows ({stats.skipped} skipped)")
    return prompts, stats


WARMUP_HOLDOUT = 256
"""(ours) The front of each dataset's shuffled order that a warm-up never trains on: the CPU recipe's validation
size, so a warm-up is the same for every validation up to it."""


@dataclass
class Splits:
    train: dict[str, list[Prompt]]
    """Per dataset (`DatasetConfig.key`): its training prompts."""
    val: dict[str, list[Prompt]]
    """Per task: the held-out validation prompts."""
    stats: dict[str, LoadStats]
    warmup: dict[str, list[Prompt]] = field(default_factory=dict)
    """Per dataset: the prompts a supervised warm-up may train on, the training prompts past the first
    `WARMUP_HOLDOUT` of the shuffled order (validation takes from its front): the same for every `val_prompts` up to
    that, so runs that differ in their validation's size start from the same warmed-up policy."""

    def fingerprints(self) -> dict[str, str]:
        """Per dataset: a hash of its training prompts in order (id, prompt, answer, tests, tools), which a checkpoint
        records so that a resume finds data changed under the same config (orchestration/resume.py)."""
        out = {}
        for key, prompts in self.train.items():
            digest = hashlib.sha256()
            for p in prompts:
                fields = [p.id, p.prompt, p.answer, p.tests] + ([list(p.tools)] if p.tools else [])
                digest.update(json.dumps(fields, sort_keys=True, default=str).encode())
            out[key] = digest.hexdigest()[:16]
        return out


def _union(first: tuple[str, ...], more: list[str]) -> tuple[str, ...]:
    return first + tuple(name for name in more if name not in first)


def load_splits(cfg: DataConfig) -> Splits:
    """Load every dataset and hold out `val_prompts` of each (at most half), chosen by `cfg.seed`."""
    train: dict[str, list[Prompt]] = {}
    val: dict[str, list[Prompt]] = {}
    warmup: dict[str, list[Prompt]] = {}
    stats: dict[str, LoadStats] = {}
    for dataset in cfg.datasets:
        if dataset.key in train:
            raise DatasetError(f"data.datasets: {dataset.key} is listed twice")
        prompts, stats[dataset.key] = load_prompts(dataset, cfg.bad_rows)
        if dataset.tools:  # every row of the dataset may call them, besides its own
            prompts = [dataclasses.replace(p, tools=_union(p.tools, dataset.tools)) for p in prompts]
        order = list(range(len(prompts)))
        random.Random(f"{cfg.seed}:{dataset.key}").shuffle(order)
        n_val = min(cfg.val_prompts if dataset.val_prompts is None else dataset.val_prompts, len(prompts) // 2)
        val.setdefault(dataset.task, []).extend(prompts[i] for i in order[:n_val])
        train[dataset.key] = [prompts[i] for i in order[n_val:]]
        warmup[dataset.key] = [prompts[i] for i in order[max(n_val, min(WARMUP_HOLDOUT, len(prompts) // 2)) :]]
    return Splits(train, val, stats, warmup)
