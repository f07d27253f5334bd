"""Export: a megatron_rl checkpoint saved under any TP/PP/EP layout -> a Hugging Face directory.

    export_hf(checkpoint_dir, out_dir)      # one process, no GPU needed

A megatron-core distributed checkpoint stores every tensor by its global shape, whatever layout wrote
it, so one process can read it as a TP=1/PP=1/EP=1 model would. That model is built on the meta device
(no memory); its sharded state dict names every canonical tensor and where it lives in the checkpoint.
The export then loads one layer's tensors at a time into fresh buffers (`dist_checkpointing.load` of that
subset), maps them to HF names (convert/, the same mapping as weight sync) and appends them to
safetensors shards of the configured size: peak memory is about one layer plus one shard.

The output: `model-0000i-of-0000N.safetensors` (or `model.safetensors`) + index, `config.json`, a
generation config, and the tokenizer files of the source HF directory (`hf_source`, by default the
`model.hf_path` the run started from). config.json is the source's (for Scout's multimodal config, its
text model) checked against the checkpoint's ModelConfig, or else generated from the ModelConfig.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig, TrainerConfig, build
from megatron_rl.convert.checkpoint_reader import CheckpointReader, Region
from megatron_rl.convert.hf_files import ShardedWriter, copy_side_files, parse_size
from megatron_rl.convert.runtime import megatron_process
from megatron_rl.models import FAMILIES, HFMapper, family, family_of, hf_configs, hf_plan, read_hf_config
from megatron_rl.trainer.checkpoint import starting_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run's checkpoint root (its `latest` marker is followed)."""
    path = Path(path)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    if not (path / "metadata.json").is_file() and not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path}: not a megatron-core distributed checkpoint (no metadata.json)")
    return path


def checkpoint_model_config(path: Path, model_cfg: ModelConfig | None) -> tuple[ModelConfig, dict[str, Any]]:
    """The ModelConfig to export: megatron_rl.json's, or `model_cfg` (which must then agree with it)."""
    meta_file = path / "megatron_rl.json"
    meta: dict[str, Any] = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    if "model" not in meta:
        if model_cfg is None:
            raise ValueError(f"{path}: no megatron_rl.json; give the model config (--model)")
        return model_cfg, meta
    try:
        saved = build(ModelConfig, meta["model"], prefix="model")
    except ConfigError as exc:
        raise ValueError(f"{meta_file}: {exc}") from None
    if model_cfg is not None:
        diffs = hf_configs.differences(saved, model_cfg, ("checkpoint", "requested"))
        if saved.family != model_cfg.family:
            diffs.insert(0, f"model.family (checkpoint {saved.family!r}, requested {model_cfg.family!r})")
        if diffs:
            raise ValueError(f"{path}: the checkpoint's model differs from the requested one: {'; '.join(diffs)}")
    return saved, meta


def _meta_model(cfg: ModelConfig, params_dtype: str) -> Any:
    from megatron_rl.trainer.model import build_model

    trainer = TrainerConfig(params_dtype=params_dtype, fp32_lm_head=False)  # type: ignore[arg-type]
    with torch.device("meta"):
        return build_model(cfg, ParallelConfig(), trainer, initialize=False)


def _groups(names: list[str]) -> Iterator[list[str]]:
    """Consecutive names of one layer (or of the embedding / final norm / output layer) together."""
    group: list[str] = []
    key: str | None = None
    for name in names:
        match = _LAYER.match(name)
        this = match.group(0) if match else name
        if group and this != key:
            yield group
            group = []
        key = this
        group.append(name)
    if group:
        yield group


def _pieces(built: Any) -> list[Any]:
    if isinstance(built, dict):
        return [p for value in built.values() for p in _pieces(value)]
    if isinstance(built, (list, tuple)):
        return [p for value in built for p in _pieces(value)]
    return [built]


def _regions(entry: Any, buffer: Tensor) -> list[Region]:
    """Where the tensor of one sharded-state entry lives in the checkpoint, read into `buffer`.

    A ShardedTensor is one region; a ShardedTensorFactory (megatron's gated fc1: gate and up halves stored
    as separate pieces) is built on `buffer`, so its pieces are views of it.
    """
    if hasattr(entry, "build"):
        pieces = _pieces(dataclasses.replace(entry, data=buffer).build())
    else:
        pieces = [dataclasses.replace(entry, data=buffer, dtype=buffer.dtype)]
    return [
        (p.key, tuple(p.global_offset), p.data.view((1,) * p.prepend_axis_num + tuple(p.local_shape))) for p in pieces
    ]


class CheckpointTensors:
    """A distributed checkpoint read as a TP=1/PP=1/EP=1 model's parameters; needs a TP=PP=EP=1 process."""

    def __init__(self, path: Path, cfg: ModelConfig, params_dtype: str) -> None:
        gpt = _meta_model(cfg, params_dtype)
        self.path, self.cfg = path, cfg
        self.names = [name for name, _ in gpt.named_parameters()]
        self.sharded = gpt.sharded_state_dict()
        absent = [name for name in self.names if name not in self.sharded]
        assert not absent, f"megatron's sharded state dict lacks parameters {absent}"
        self.reader = CheckpointReader(path)
        unsaved = sorted({self.sharded[n].key for n in self.names} - self.reader.keys())
        if unsaved:
            raise ValueError(
                f"{path}: the checkpoint lacks tensors the {cfg.family} model needs (checkpoint keys): "
                f"{unsaved[:50]}" + (f" ... and {len(unsaved) - 50} more" if len(unsaved) > 50 else "")
            )

    def canonical(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(canonical name, full shape, saved dtype) of every tensor, in order."""
        return [(n, tuple(self.sharded[n].data.shape), self.reader.dtype(self.sharded[n].key)) for n in self.names]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        """(canonical name, full tensor), one layer read at a time."""
        for group in _groups(self.names):
            buffers = {
                n: torch.empty(tuple(self.sharded[n].data.shape), dtype=self.reader.dtype(self.sharded[n].key))
                for n in group
            }
            self.reader.read([region for n in group for region in _regions(self.sharded[n], buffers[n])])
            for name in group:
                yield name, buffers[name]


def _config_json(cfg: ModelConfig, source: Path | None, dtype_name: str) -> dict[str, Any]:
    module = family(cfg)
    if source is not None and (source / "config.json").is_file():
        hf = getattr(module, "text_config", lambda hf: hf)(read_hf_config(source))
        if family_of(hf) != cfg.family:
            raise ValueError(f"{source}: config.json is a {family_of(hf)} model, the checkpoint a {cfg.family}")
        diffs = hf_configs.differences(cfg, FAMILIES[cfg.family].model_config(hf, cfg.name))
        if diffs:
            raise ValueError(f"{source}/config.json disagrees with the checkpoint's model: {'; '.join(diffs)}")
        hf = dict(hf)
    else:
        hf = _generated_config(cfg)
    hf.pop("torch_dtype", None)
    hf["dtype"] = dtype_name
    return hf


def _generated_config(cfg: ModelConfig) -> dict[str, Any]:
    """A full config.json from the ModelConfig, via the transformers config class (its defaults filled in)."""
    from transformers import AutoConfig

    kwargs = family(cfg).hf_config(cfg)
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    return config.to_dict()  # type: ignore[no-any-return]


def _write_generation_config(out: Path, hf: dict[str, Any]) -> None:
    if (out / "generation_config.json").exists():
        return
    from transformers import GenerationConfig

    ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
    GenerationConfig(**ids).save_pretrained(out)


def export_hf(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    model_cfg: ModelConfig | None = None,
    hf_source: str | Path | None = None,
    shard_size: str | int = "5GB",
    dtype: str | None = None,
    progress: bool = True,
) -> Path:
    """Write the HF directory `out_dir` from a megatron_rl (or plain megatron-core model) checkpoint.

    `dtype` (bf16 | fp16 | fp32) casts every tensor; None keeps each tensor's saved dtype (an fp32 LM
    head stays fp32). Runs in this process as a TP=PP=EP=1 megatron rank (no other layout may be active).
    """
    from tqdm import tqdm

    path = resolve_checkpoint(checkpoint_dir)
    cfg, meta = checkpoint_model_config(path, model_cfg)
    family(cfg).check(cfg)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)} or None, got {dtype!r}")
    params_dtype = meta.get("params_dtype", "bf16")
    if hf_source and not Path(hf_source).is_dir():
        raise FileNotFoundError(f"hf_source: {hf_source} is not a directory")
    # Else the model's hf_path, or the HF directory the run recorded as its start (the CPU run's warmed-up
    # tiny model); when both are gone, config.json is generated and no tokenizer is written.
    candidates = [Path(hf_source)] if hf_source else [Path(p) for p in (cfg.hf_path,) if p]
    candidates.append(starting_model(path))  # type: ignore[arg-type]
    source = next((c for c in candidates if c is not None and c.is_dir()), None)
    out = Path(out_dir)
    if out.exists() and any(out.glob("*.safetensors")):
        raise FileExistsError(f"{out}: already holds safetensors files")
    out.mkdir(parents=True, exist_ok=True)
    mapper = HFMapper(cfg)
    cast = DTYPES[dtype] if dtype else None
    start = time.perf_counter()
    with megatron_process(ParallelConfig()):
        tensors = CheckpointTensors(path, cfg, params_dtype)
        canonical = tensors.canonical()
        plan = hf_plan(cfg, [(name, shape, cast or saved) for name, shape, saved in canonical])
        writer = ShardedWriter(out, parse_size(shard_size), plan)
        total = sum(math.prod(shape) * saved.itemsize for _, shape, saved in canonical)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"export {path.name}", disable=not progress) as bar:
            for name, tensor in tensors:
                for hf_name, hf_tensor in mapper.map(name, tensor.to(cast) if cast is not None else tensor):
                    writer.add(hf_name, hf_tensor)
                bar.update(tensor.numel() * tensor.element_size())
    mapper.finish()
    files = writer.close()
    dtype_name = HF_DTYPE_NAMES[cast or DTYPES[params_dtype]]
    hf = _config_json(cfg, source, dtype_name)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    copied = copy_side_files(source, out) if source is not None else []
    _write_generation_config(out, hf)
    if progress:
        print(
            f"export: {len(files)} safetensors file(s), {writer.total_bytes / 1e9:.3f} GB in "
            f"{time.perf_counter() - start:.1f} s -> {out}"
            + (f"; copied {', '.join(copied)} from {source}" if copied else "; no tokenizer files (no source dir)"),
            file=sys.stderr,
        )
    return out
