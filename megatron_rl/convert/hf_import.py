"""Import: a Hugging Face checkpoint directory into megatron, streamed tensor by tensor.

    load_hf_into_model(model, cfg, hf_dir)             every rank of a built model loads its shards
    import_hf(hf_dir, cfg, parallel, out=ckpt_dir)     a megatron_rl checkpoint written by the layout's
                                                       tp x pp x ep ranks (spawned here, or the torchrun
                                                       ranks this runs under)

Before anything is read, the directory is checked against the model: config.json against the
ModelConfig (architecture fields), then the HF tensor names and shapes against what the megatron model
needs. Errors list every missing tensor, extra tensor and shape mismatch (HF name, expected, got).
Then each canonical tensor is built from its HF tensors (memory-mapped safetensors) only on the ranks
that keep part of it and copied into their shards: a rank holds its model shard plus one full tensor.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_rl.config import ModelConfig, ParallelConfig, TrainerConfig
from megatron_rl.convert.hf_files import HFReader
from megatron_rl.convert.hf_headers import HeaderIndex, check_config_json, verify_hf_files
from megatron_rl.convert.runtime import megatron_process, spawn
from megatron_rl.models import (
    canonical_shapes,
    family,
    from_hf,
    hf_shapes,
    model_config_from_hf,
)

ALWAYS_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some older checkpoints saved; not weights."""


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _listed(kind: str, names: list[str], limit: int = 50) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"{len(names)} {kind}: {', '.join(names[:limit])}{more}"


def verify_hf_checkpoint(cfg: ModelConfig, hf_dir: str | Path) -> HeaderIndex:
    """The HF directory a run starts from, checked against the model before anything starts: config.json's
    architecture and dimensions, then every weight file (present, complete) and every tensor's name and shape,
    from the files' headers alone (nothing is loaded). Raises ValueError naming what differs."""
    index = verify_hf_files(cfg, hf_dir)
    module = family(cfg)
    index.prefix = getattr(module, "checkpoint_prefix", lambda names: "")(index.names)
    shapes = hf_shapes(cfg, canonical_shapes(cfg).items())
    check_hf_tensors(index, cfg, set(shapes), shapes)
    return index


def check_hf_tensors(
    reader: HFReader | HeaderIndex, cfg: ModelConfig, needed: set[str], shapes: dict[str, tuple[int, ...]]
) -> None:
    """Missing, extra and mis-shaped HF tensors, all listed in one ValueError."""
    module = family(cfg)
    skipped = getattr(module, "skipped", lambda name: False)
    logical = {n.removeprefix(reader.prefix) for n in reader.names if n.startswith(reader.prefix)}
    outside = {n for n in reader.names if not n.startswith(reader.prefix)}
    missing = sorted(needed - logical)
    extra = sorted(
        n for n in (logical - needed) | outside if not skipped(n) and not n.endswith(ALWAYS_SKIPPED_SUFFIXES)
    )
    mismatched = [
        f"{n} (expected {shapes[n]}, got {reader.shape(n)})"
        for n in sorted(needed & logical)
        if reader.shape(n) != shapes[n]
    ]
    problems = [
        _listed(kind, names)
        for kind, names in (
            ("missing tensors", missing),
            ("unexpected tensors", extra),
            ("shape mismatches", mismatched),
        )
        if names
    ]
    if problems:
        raise ValueError(f"{reader.dir}: does not match the {cfg.family} model: {'; '.join(problems)}")
    ignored = sorted(n for n in reader.names if skipped(n))
    if ignored and _is_rank0():
        print(f"import: {len(ignored)} tensors not imported (text model only): {ignored[0]}, ...", file=sys.stderr)


def load_hf_into_model(model: Any, cfg: ModelConfig, hf_dir: str | Path, progress: bool = True) -> None:
    """Import into a built (possibly sharded) GPTModel; collective: every trainer rank calls it."""
    from tqdm import tqdm

    from megatron_rl.trainer.weights import full_shapes, load_full_weights

    hf_dir = Path(hf_dir)
    module = family(cfg)
    module.check(cfg)
    check_config_json(cfg, hf_dir)
    reader = HFReader(hf_dir)
    reader.prefix = getattr(module, "checkpoint_prefix", lambda names: "")(reader.names)
    recipes = list(from_hf(cfg))
    canonical = full_shapes(model)
    shapes = hf_shapes(cfg, [(name, shape) for name, shape, _ in canonical])
    needed = {hf for recipe in recipes for hf in recipe.reads}
    assert needed == set(shapes), f"{cfg.family} mapping: recipes read {needed ^ set(shapes)} inconsistently"
    check_hf_tensors(reader, cfg, needed, shapes)
    nbytes = {name: torch.Size(shape).numel() * dtype.itemsize for name, shape, dtype in canonical}
    bar = tqdm(
        total=sum(nbytes.values()),
        unit="B",
        unit_scale=True,
        desc=f"import {hf_dir.name}",
        disable=not (progress and _is_rank0()),
    )

    def stream() -> Any:
        for recipe in recipes:
            yield recipe.name, partial(recipe.build, reader)
            bar.update(nbytes.get(recipe.name, 0))

    try:
        load_full_weights(model, stream())
    finally:
        bar.close()
        reader.close()


def check_layout(parallel: ParallelConfig) -> None:
    """The megatron process groups in place must be the requested TP/PP/EP layout."""
    from megatron.core import parallel_state as ps

    in_use = (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )
    if in_use != (parallel.tp, parallel.pp, parallel.ep):
        raise ValueError(
            f"layout mismatch: the model runs with tp/pp/ep={in_use}, the request is "
            f"tp/pp/ep={(parallel.tp, parallel.pp, parallel.ep)}"
        )


def write_metadata(out: Path, cfg: ModelConfig, parallel: ParallelConfig, params_dtype: str, source: Path) -> None:
    """megatron_rl.json and run_state.pt of trainer/checkpoint.py for a step-0 checkpoint (rank 0)."""
    model = dataclasses.asdict(cfg)
    model["hf_path"] = model["hf_path"] or str(source)  # export finds the tokenizer and config.json there
    meta = {
        "step": 0,
        "model": model,
        "parallel": dataclasses.asdict(parallel),
        "params_dtype": params_dtype,
        "imported_from": str(source),
    }
    (out / "megatron_rl.json").write_text(json.dumps(meta, indent=2) + "\n")
    torch.save({"trainer": {"step": 0, "skipped_steps": 0}, "run": {}}, out / "run_state.pt")


def _import_rank(hf_dir: Path, cfg: ModelConfig, parallel: ParallelConfig, trainer: TrainerConfig, out: Path) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.trainer.model import build_model

    with megatron_process(parallel, trainer.seed, cfg.is_moe):
        start = time.perf_counter()
        model = build_model(cfg, parallel, trainer, initialize=False)  # every weight comes from the files
        built = time.perf_counter()
        load_hf_into_model(model, cfg, hf_dir)
        loaded = time.perf_counter()
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save({"model": model.sharded_state_dict()}, str(out))
        if dist.get_rank() == 0:
            write_metadata(out, cfg, parallel, trainer.params_dtype, hf_dir)
        dist.barrier()
        if dist.get_rank() == 0:
            print(
                f"import: rank 0 built its model chunk in {built - start:.1f} s, loaded the HF tensors in "
                f"{loaded - built:.1f} s, saved the checkpoint in {time.perf_counter() - loaded:.1f} s",
                file=sys.stderr,
            )


def import_hf(
    hf_dir: str | Path,
    model_cfg: ModelConfig | None = None,
    parallel: ParallelConfig | None = None,
    out: str | Path | None = None,
    *,
    model: Any = None,
    params_dtype: str = "bf16",
    fp32_lm_head: bool = True,
) -> Any:
    """HF directory -> `model` (this rank's shards; returned) or -> a megatron_rl checkpoint at `out`.

    `model_cfg` defaults to the one config.json describes. For a checkpoint, the layout's
    `parallel.trainer_devices` ranks each build their chunk, load it and save collectively; run under
    torchrun with that many ranks, or alone (the ranks are spawned here, CPU or one GPU each).
    `params_dtype` / `fp32_lm_head` are the trainer's (trainer.params_dtype, trainer.fp32_lm_head).
    """
    hf_dir = Path(hf_dir)
    cfg = model_cfg or model_config_from_hf(hf_dir)
    if model is not None:
        if parallel is not None:
            check_layout(parallel)
        load_hf_into_model(model, cfg, hf_dir)
        return model
    if out is None:
        raise ValueError("import_hf: give `model` (load into it) or `out` (write a checkpoint)")
    parallel = parallel or ParallelConfig()
    family(cfg).check(cfg)
    check_config_json(cfg, hf_dir)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: the output checkpoint directory is not empty")
    trainer = TrainerConfig(params_dtype=params_dtype, fp32_lm_head=fp32_lm_head)  # type: ignore[arg-type]
    import torch.distributed as dist

    if dist.is_initialized() or parallel.trainer_devices == 1:
        _import_rank(hf_dir, cfg, parallel, trainer, out)
    else:
        spawn(_import_rank, parallel, hf_dir, cfg, parallel, trainer, out)
    return out
