"""Downstream benchmarks: AIME 2024 and 2025, MATH-500, LiveCodeBench, and a synthetic CPU set.

    load_benchmark(BenchmarkConfig("aime24"))                       the hub set lighteval and open-r1 use
    load_benchmark(BenchmarkConfig("math500", source="/data/math500.jsonl"))   the same schema from a local file
    load_benchmark(BenchmarkConfig("livecodebench", version="release_v5",
                                   start_date="2024-08-01", end_date="2025-02-01"))

Each benchmark is read from its hub name with `datasets`, or from a local .jsonl/.parquet file in the same
schema (GPU nodes often have no internet: fetch once with `huggingface-cli download <hub> --repo-type dataset
--local-dir DIR` and point `source` at the file). Rows become `Prompt`s scored by the project's own rewards
(math: Math-Verify against the reference; code: the sandboxed tests), so a downstream pass is judged exactly
as a training reward is.

    aime24          HuggingFaceH4/aime_2024 (train)        problem, answer, id
    aime25          yentinglin/aime_2025 (train)           problem (or question), answer, id
    math500         HuggingFaceH4/MATH-500 (test)          problem, answer, unique_id
    livecodebench   livecodebench/code_generation_lite     question_content, starter_code, public_test_cases,
                    (its release files)                    private_test_cases, metadata.func_name, contest_date
    synthetic_large generated, no download                 the additions with sums >= 180, never training rows

LiveCodeBench: `version` picks the release files as its harness does (release_vN = test.jsonl .. testN.jsonl,
vN = the problems added in release N alone), and `start_date`/`end_date` keep the problems whose contest date is
in the window (inclusive), to keep out problems published before a model's cut-off. Its private tests are stored
as JSON, or as base64 of zlib of a pickled JSON string; that pickle is read with an unpickler that builds only
strings and refuses any class, so a forged file cannot run code.

A row with a missing field, an answer Math-Verify cannot parse, or tests that do not decode is counted and
skipped (`BenchmarkSet.skipped`, with the first messages naming file, row and field); a benchmark left with no
valid row, or an unknown benchmark name, raises `DatasetError`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from megatron_rl.config import BenchmarkConfig
from megatron_rl.data.code_tests import normalise_tests
from megatron_rl.data.datasets import DatasetError, Prompt, read_rows
from megatron_rl.data.livecodebench import lcb_cases, lcb_prompt
from megatron_rl.data.synthetic import large_sum_rows


@dataclass
class BenchmarkSet:
    """One benchmark's problems, ready to sample."""

    name: str
    task: str
    source: str
    """Where the rows came from (hub name with its files or split, or the local path)."""
    prompts: list[Prompt]
    rows: int = 0
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    """The first few skipped rows' messages."""
    window: str | None = None
    """LiveCodeBench: the version and contest-date window applied."""


@dataclass(frozen=True)
class Spec:
    task: str
    hub: str
    split: str
    parse: Callable[[dict[str, Any], str, int, BenchmarkConfig], Prompt | None]
    """(row, where, index, cfg) -> Prompt, None for a row outside the window, DatasetError for a bad one."""


def _math_row(row: dict[str, Any], where: str, index: int, cfg: BenchmarkConfig) -> Prompt:
    problem = _first(row, ("problem", "question", "Problem", "Question"))
    if not isinstance(problem, str) or not problem.strip():
        raise DatasetError(f"{where}: field 'problem' missing or empty (accepted: problem, question)")
    answer = _first(row, ("answer", "Answer", "final_answer"))
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise DatasetError(f"{where}: field 'answer' missing or empty")
    if not _parses(answer):
        raise DatasetError(f"{where}: field 'answer' {answer[:60]!r} does not parse as a math answer (Math-Verify)")
    key = _first(row, ("id", "ID", "unique_id", "problem_id"))
    return Prompt(id=f"{cfg.name}-{key if key is not None else index}", task="math", prompt=problem, answer=answer)


INTEGER = re.compile(r"[-+]?\d+")


def _parses(answer: str) -> bool:
    """Math-Verify finds an answer in the reference (boxed, as the math reward reads it). Its timeout is a
    SIGALRM, so it is used in the main thread only (where runs and `megatron-rl eval` load benchmarks). An integer
    always parses, so a benchmark of integer answers (AIME's, the synthetic sums') is checked without importing
    Math-Verify and SymPy into the driver (~45 MB it would hold for the whole run)."""
    if INTEGER.fullmatch(answer.strip()):
        return True
    from math_verify import parse

    boxed = answer if "\\boxed" in answer else f"\\boxed{{{answer}}}"
    main = threading.current_thread() is threading.main_thread()
    try:
        return bool(parse(boxed, parsing_timeout=5 if main else 0, raise_on_error=main))
    except Exception:  # its TimeoutException or a parser error: no answer Math-Verify can read
        return False


def _first(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if row.get(name) is not None:
            return row[name]
    return None


def _day(value: Any, where: str, field_name: str) -> date:
    try:
        return date.fromisoformat(str(value)[:10])
    except ValueError:
        raise DatasetError(f"{where}: field '{field_name}' {value!r} is not an ISO date (YYYY-MM-DD...)") from None


def _lcb_row(row: dict[str, Any], where: str, index: int, cfg: BenchmarkConfig) -> Prompt | None:
    for name in ("question_content", "public_test_cases", "contest_date"):
        if row.get(name) is None:
            raise DatasetError(f"{where}: field '{name}' missing (LiveCodeBench code_generation_lite schema)")
    contest = _day(row["contest_date"], where, "contest_date")
    if cfg.start_date and contest < date.fromisoformat(cfg.start_date):
        return None
    if cfg.end_date and contest > date.fromisoformat(cfg.end_date):
        return None
    cases = lcb_cases(row["public_test_cases"], where, "public_test_cases")
    if row.get("private_test_cases"):
        cases = cases + lcb_cases(row["private_test_cases"], where, "private_test_cases")
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata) if metadata.strip() else {}
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: field 'metadata' is not JSON ({exc})") from None
    if metadata.get("func_name"):
        cases = [{**case, "metadata": {"func_name": metadata["func_name"]}} for case in cases]
    try:
        tests = normalise_tests(cases)
    except ValueError as exc:
        raise DatasetError(f"{where}: field 'public_test_cases'/'private_test_cases': {exc}") from None
    key = row.get("question_id") or index
    prompt = lcb_prompt(str(row["question_content"]), str(row.get("starter_code") or ""))
    return Prompt(id=f"livecodebench-{key}", task="code", prompt=prompt, tests=tests)


LCB_FILES = ["test.jsonl", *(f"test{n}.jsonl" for n in range(2, 7))]
"""code_generation_lite's files, one per release (release_v1 .. release_v6)."""


def lcb_files(version: str) -> list[str]:
    """The files of a LiveCodeBench version tag: release_vN (cumulative), vN (release N's additions),
    release_latest (all)."""
    if version == "release_latest":
        return list(LCB_FILES)
    for prefix, cumulative in (("release_v", True), ("v", False)):
        number = version.removeprefix(prefix)
        if version.startswith(prefix) and number.isdigit() and 1 <= int(number) <= len(LCB_FILES):
            n = int(number)
            return LCB_FILES[:n] if cumulative else [LCB_FILES[n - 1]]
    raise DatasetError(
        f"livecodebench: version {version!r} is not a release tag; known: release_v1 .. release_v{len(LCB_FILES)}, "
        f"release_latest, v1 .. v{len(LCB_FILES)}"
    )


BENCHMARKS: dict[str, Spec] = {
    "aime24": Spec("math", "HuggingFaceH4/aime_2024", "train", _math_row),
    "aime25": Spec("math", "yentinglin/aime_2025", "train", _math_row),
    "math500": Spec("math", "HuggingFaceH4/MATH-500", "test", _math_row),
    "livecodebench": Spec("code", "livecodebench/code_generation_lite", "train", _lcb_row),
    "synthetic_large": Spec("math", "", "", _math_row),
}


def load_benchmark(cfg: BenchmarkConfig) -> BenchmarkSet:
    """The valid problems of one benchmark; bad rows counted and skipped (see the module docstring)."""
    spec = BENCHMARKS.get(cfg.name)
    if spec is None:
        raise DatasetError(f"eval.downstream.benchmarks: unknown benchmark {cfg.name!r}; known: {sorted(BENCHMARKS)}")
    window = None
    if cfg.name == "livecodebench":
        window = f"{cfg.version}, contests {cfg.start_date or 'any'} .. {cfg.end_date or 'any'}"
    source, rows = _benchmark_rows(cfg, spec)
    out = BenchmarkSet(cfg.name, spec.task, source, [], window=window)
    for index, (line, row) in enumerate(rows):
        where = f"{source}: row {line}"
        out.rows += 1
        try:
            if isinstance(row, DatasetError):
                raise row
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
            prompt = spec.parse(row, where, index, cfg)
        except DatasetError as exc:
            out.skipped += 1
            if len(out.errors) < 5:
                out.errors.append(str(exc))
            continue
        if prompt is None:  # outside LiveCodeBench's date window: not a bad row
            out.rows -= 1
            continue
        out.prompts.append(prompt)
        if cfg.limit is not None and len(out.prompts) >= cfg.limit:
            break
    if not out.prompts:
        first = f"; first: {out.errors[0]}" if out.errors else ""
        empty = f" in the window {window}" if window and not out.skipped else ""
        raise DatasetError(f"{source}: no valid rows{empty} ({out.skipped} of {out.rows} skipped){first}")
    if cfg.tools:
        out.prompts = [dataclasses.replace(p, tools=tuple(cfg.tools)) for p in out.prompts]
    ids = [p.id for p in out.prompts]
    if len(set(ids)) != len(ids):  # per-problem results are keyed by id
        for n, prompt in enumerate(out.prompts):
            prompt.id = f"{prompt.id}#{n}"
    return out


def _benchmark_rows(cfg: BenchmarkConfig, spec: Spec) -> tuple[str, list[tuple[int | str, Any]]]:
    """(a name for messages, the raw rows with their 1-based line or position)."""
    if cfg.name == "synthetic_large":
        return "synthetic:large_sums", list(enumerate(large_sum_rows(), start=1))
    if cfg.source is not None and Path(cfg.source).suffix in (".jsonl", ".parquet"):
        local: list[tuple[int | str, Any]] = [*read_rows(cfg.source, "train")]
        return cfg.source, local
    hub = cfg.source or spec.hub
    if cfg.name == "livecodebench":
        files = lcb_files(cfg.version)
        if Path(hub).is_dir():  # a downloaded copy of the dataset repository: the version's files in it
            rows: list[tuple[int | str, Any]] = []
            for name in files:
                if not (Path(hub) / name).exists():
                    raise DatasetError(f"{hub}: {name} missing (livecodebench {cfg.version} reads {files})")
                rows += [(f"{name}:{line}", row) for line, row in read_rows(str(Path(hub) / name), "train")]
            return f"{hub} ({cfg.version})", rows
        return f"{hub} ({cfg.version})", _hub_rows(hub, "train", files)
    split = cfg.split or spec.split
    return f"{hub} ({split})", _hub_rows(hub, split, None)


def _hub_rows(hub: str, split: str, files: list[str] | None) -> list[tuple[int | str, Any]]:
    import datasets

    try:
        data = datasets.load_dataset(hub, split=split, data_files=files)
    except Exception as exc:  # the hub client raises many types; name the source and keep the cause
        raise DatasetError(
            f"{hub}: could not load ({type(exc).__name__}: {exc}); without internet, download it once "
            f"(huggingface-cli download {hub} --repo-type dataset --local-dir DIR) and set the benchmark's source "
            "to the .jsonl/.parquet file"
        ) from exc
    return list(enumerate(data, start=1))
