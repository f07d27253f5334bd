"""The policy RL starts from: `model.hf_path`, or (the CPU run) a tiny model built here and given a non-zero
starting pass rate by a supervised warm-up.

    policy = prepare_policy(run, splits)          # an HF directory: the given checkpoint or the cached warm model

RL improves a policy that sometimes succeeds; a random 1M-parameter model never does. The CPU run
therefore first fine-tunes its freshly built model on worked solutions of the synthetic task (plain
torch on the Hugging Face model, loss on the completion tokens only) for a fixed number of steps, then
starts RL from that checkpoint. The warm-up is deliberately short: the RL phase must have headroom.
The result is cached by its inputs (the directory name ends with their hash, so runs with different data
splits keep their own policies side by side) and written atomically, so repeated runs skip it and
concurrent ones never read a half-written policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError, RunConfig, ToolsConfig
from megatron_rl.data.datasets import Prompt, Splits
from megatron_rl.data.synthetic import PROGRAMS, SOLUTIONS, Program
from megatron_rl.data.tokenizer import REVISION as TOKENIZER_REVISION
from megatron_rl.rollout.session import PromptEncoder
from megatron_rl.rollout.tools import format_call

POLICY_CACHE = Path.home() / ".cache" / "megatron_rl"


@dataclass
class WarmupTask:
    """One synthetic task's training prompts, its worked-solution function, and its share of each batch."""

    prompts: list[Prompt]
    solution: Callable[..., str]
    """`solution(prompt, slip=..., rng=...)`, as in `data.synthetic.SOLUTIONS`."""
    weight: float = 1.0
    program: Program | None = None
    """`program(prompt, slip=..., rng=...) -> (code, output)` (`data.synthetic.PROGRAMS`): what a solution that
    calls the Python tool runs."""
    tool_share: float = 0.0
    """Share of this task's solutions that call the tool (`trainer.warm_start_tool_share` where the dataset
    declares `python`)."""
    tool_slip: float | None = None
    """The slip of those solutions (`trainer.warm_start_tool_slip`); None = the warm-up's `slip`."""


def prepare_policy(run: RunConfig, splits: Splits, cache: Path = POLICY_CACHE) -> Path:
    """The Hugging Face directory RL starts from: `model.hf_path`, or a tiny model built here and warmed up
    on the synthetic task's worked solutions (`trainer.warm_start_steps`)."""
    if run.model.hf_path:
        from megatron_rl.convert.hf_headers import verify_hf_files

        path = Path(run.model.hf_path)
        try:  # before the trainer ranks and engines start: another model, or weights missing or cut short (without
            # torch; each trainer rank checks every tensor's name and shape as it imports them, and the driver does
            # when an engine fails to start: train.py `_engines_started`)
            verify_hf_files(run.model, path)
        except ValueError as exc:
            raise ConfigError(f"model.hf_path: {exc}") from None
        return path
    base = base_model(run, cache)
    if run.trainer.warm_start_steps == 0:
        return base
    tasks = []
    for i, dataset in enumerate(run.data.datasets):
        name = dataset.source.removeprefix("synthetic:")
        if not dataset.source.startswith("synthetic:") or name not in SOLUTIONS:
            raise ConfigError(
                f"trainer.warm_start_steps: the warm-up needs synthetic tasks with worked solutions "
                f"({sorted(SOLUTIONS)}); data.datasets[{i}].source is {dataset.source!r}"
            )
        share = run.trainer.warm_start_tool_share if "python" in dataset.tools else 0.0
        if share and name not in PROGRAMS:
            raise ConfigError(
                f"trainer.warm_start_tool_share: data.datasets[{i}] ({dataset.source}) has no tool solutions; "
                f"tasks with them: {sorted(PROGRAMS)}"
            )
        program, tool_slip = PROGRAMS.get(name), run.trainer.warm_start_tool_slip
        tasks.append(WarmupTask(splits.warmup[dataset.key], SOLUTIONS[name], dataset.weight, program, share, tool_slip))
    names = "+".join(d.source.removeprefix("synthetic:") for d in run.data.datasets[1:])
    out = cache / f"{run.model.name}-seed{run.seed}-warm{run.trainer.warm_start_steps}{'-' + names if names else ''}"
    slip = run.trainer.warm_start_slip
    steps = run.trainer.warm_start_steps
    return warm_start(base, out, tasks, steps=steps, seed=run.seed, slip=slip, tools=run.rollout.tools)


def base_model(run: RunConfig, cache: Path = POLICY_CACHE) -> Path:
    """The tiny model of `run.model` with random weights from `run.seed`, built once per architecture and seed.

    Built aside and renamed into place, and reused when complete: never rewritten where a concurrent run may be
    reading it. The directory name ends with a hash of the model config (and the tokenizer's revision), so an edited
    config gets its own model (and the warm-up, keyed on this path, its own warmed policy)."""
    inputs = [dataclasses.asdict(run.model), run.seed, TOKENIZER_REVISION]
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    out = cache / f"{run.model.name}-seed{run.seed}-{key[:16]}"
    if _complete(out, key):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        from megatron_rl.models.tiny import build_tiny_model  # torch: only when a model is built

        build_tiny_model(staging, run.model, seed=run.seed)
        (staging / MARKER).write_text(json.dumps({"key": key}))
        if out.exists() and not _complete(out, key):
            shutil.rmtree(out)  # an interrupted write from before atomic staging
        staging.rename(out)
    except OSError:
        if not _complete(out, key):  # not a concurrent run finishing first with the same model: a real error
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def warm_start(
    model_dir: Path,
    out_dir: Path,
    tasks: list[WarmupTask],
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    slip: float = 0.0,
    tools: ToolsConfig | None = None,
) -> Path:
    """Fine-tune the HF model in `model_dir` on worked solutions of `tasks` (mixed by weight per batch
    row), each step of a solution written with a slip with chance `slip`; save it to `out_dir`. A task with a
    `tool_share` writes that share of its solutions as a call of the Python tool in `tools`' format, its output
    injected as the environment would and left out of the loss, as RL leaves it out."""
    inputs: list[object] = [str(model_dir), len(tasks[0].prompts), steps, batch_size, lr, seed]
    if slip:
        inputs.append(slip)
    if len(tasks) > 1:
        inputs.append([(len(t.prompts), t.solution.__name__, t.weight) for t in tasks])
    if any(t.tool_share for t in tasks):
        assert tools is not None, "a warm-up with tool solutions needs the tools' format"
        inputs.append([[t.tool_share for t in tasks], tools.call_start, tools.call_end, tools.response_template])
        if any(t.tool_slip is not None for t in tasks):
            inputs.append([t.tool_slip for t in tasks])
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]
    out_dir = out_dir.with_name(f"{out_dir.name}-{key}")
    if _complete(out_dir, key):
        return out_dir  # the driver holds no torch when the warm-up was done before
    with _one_builder(out_dir):
        if _complete(out_dir, key):  # a concurrent run with the same inputs built it meanwhile
            return out_dir
        import torch

        # As many threads as a trainer rank takes (OMP_NUM_THREADS): torch's default (every core) makes two runs
        # warming up at once on one machine oversubscribe it many times over.
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        try:
            return _warm_start(model_dir, out_dir, tasks, steps, batch_size, lr, seed, slip, key, tools)
        finally:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def _one_builder(out: Path) -> Iterator[None]:
    """Held while `out` is built: runs started together with the same inputs (a sweep's, a test session's) wait for
    the first one's warm-up and reuse it instead of repeating it on the same cores. An exclusive lock on a file beside
    `out`, released by the kernel when its holder exits, however it exits; the file is removed by its holder (a run
    that waited on it, or comes later, finds `out` complete, or builds it under a lock of its own)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f".{out.name}.lock"
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"warm-up: waiting for another run's warm-up of {out.name}", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)


def _warm_start(
    model_dir: Path,
    out_dir: Path,
    tasks: list[WarmupTask],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    slip: float,
    key: str,
    tools: ToolsConfig | None,
) -> Path:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 20) * (1 - i / steps))

    encoder = PromptEncoder(tokenizer)

    def encode(task: WarmupTask, prompt: Prompt) -> tuple[list[int], list[bool]]:
        return encode_example(
            tokenizer, encoder, solution_segments(task, prompt, slip, rng, tools, tokenizer.eos_token), prompt
        )

    def draw() -> list[tuple[WarmupTask, Prompt]]:
        if len(tasks) == 1:
            return [(tasks[0], p) for p in rng.sample(tasks[0].prompts, batch_size)]
        chosen = rng.choices(tasks, weights=[t.weight for t in tasks], k=batch_size)
        return [(task, rng.choice(task.prompts)) for task in chosen]

    losses = []
    for _ in tqdm(range(steps), desc="warm-up (supervised)", leave=False):
        batch = [encode(task, p) for task, p in draw()]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attend = torch.zeros((batch_size, width), dtype=torch.bool)
        for row, (ids, trained) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.where(torch.tensor(trained), torch.tensor(ids), -100)
            attend[row, : len(ids)] = True
        loss = model(input_ids=input_ids, attention_mask=attend, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    for extra in ("generation_config.json",):
        if (model_dir / extra).exists():
            shutil.copy(model_dir / extra, staging / extra)
    (staging / MARKER).write_text(json.dumps({"key": key, "steps": steps, "final_loss": sum(losses[-10:]) / 10}))
    if out_dir.exists() and not _complete(out_dir, key):
        shutil.rmtree(out_dir)  # an interrupted write from before atomic staging
    try:
        staging.rename(out_dir)
    except OSError:  # a concurrent run with the same inputs finished first: same policy, keep theirs
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def solution_segments(
    task: WarmupTask, prompt: Prompt, slip: float, rng: random.Random, tools: ToolsConfig | None, eos: str
) -> list[tuple[str, bool]]:
    """A worked solution of `prompt` as (text, trained) segments: the policy's text, and a tool's output, which
    the environment writes (not trained on). A share `task.tool_share` of them calls the Python tool."""
    if task.tool_share and task.program is not None and tools is not None and rng.random() < task.tool_share:
        tool_slip = slip if task.tool_slip is None else task.tool_slip
        code, output = task.program(prompt.prompt, slip=tool_slip, rng=rng)
        return [
            ("<think>" + format_call("python", {"code": code}, tools), True),
            (tools.response_template.format(output=output), False),
            (f"</think>\\boxed{{{output}}}{eos}", True),
        ]
    return [(task.solution(prompt.prompt, slip=slip, rng=rng) + eos, True)]


def encode_example(
    tokenizer: Any, encoder: PromptEncoder, segments: list[tuple[str, bool]], prompt: Prompt
) -> tuple[list[int], list[bool]]:
    """The prompt's ids (as a run encodes it, tools shown) then each segment's, tokenised apart as a trajectory's
    segments are; and per id whether it is trained on (the prompt and the environment's segments are not)."""
    ids = encoder.encode(prompt)
    trained = [False] * len(ids)
    for text, learn in segments:
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += part
        trained += [learn] * len(part)
    return ids, trained


MARKER = "warm_start.json"


def _complete(out_dir: Path, key: str) -> bool:
    marker = out_dir / MARKER
    try:
        return json.loads(marker.read_text()).get("key") == key
    except (OSError, ValueError):
        return False
