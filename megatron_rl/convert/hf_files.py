"""Hugging Face checkpoint directories on disk: lazy tensor reading, sharded safetensors writing, side files.

    reader = HFReader(hf_dir)                  # model.safetensors or model.safetensors.index.json
    reader.get(name); reader.get_index(name, e) # a tensor, or one slice of its first dimension
    index = HeaderIndex(hf_dir)                # every tensor's name and shape from the files' headers, each file
                                               # checked complete (nothing mapped, no tensor read)
    writer = ShardedWriter(out_dir, max_shard_bytes, plan)  # plan: every (name, shape, dtype), in order
    writer.add(name, tensor) ...; writer.close() # model-0000i-of-0000N.safetensors + index (or one file)
    copy_side_files(src, dst)                   # tokenizer files, generation config, chat template

Nothing here holds more than one tensor: the reader memory-maps, the writer streams each tensor into its
shard (shards are cut from the plan; a tensor larger than the limit gets a shard alone, as in transformers).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megatron_rl.convert.hf_headers import INDEX, SINGLE, HeaderIndex

__all__ = ["INDEX", "SINGLE", "HFReader", "HeaderIndex", "ShardedWriter", "copy_side_files", "parse_size"]
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files copied verbatim from the source HF directory on export (those that exist)."""


class HFReader:
    """Tensors of an HF checkpoint directory by name, opened lazily (memory-mapped) file by file."""

    def __init__(self, hf_dir: str | Path, prefix: str = "") -> None:
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        self.prefix = prefix
        if (self.dir / INDEX).exists():
            weight_map: dict[str, str] = json.loads((self.dir / INDEX).read_text())["weight_map"]
        elif (self.dir / SINGLE).exists():
            with safe_open(self.dir / SINGLE, "pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)  # noqa: SIM118 (safe_open is not iterable)
        elif any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pth")):
            raise ValueError(f"{self.dir}: only safetensors checkpoints are read; convert the .bin/.pth files first")
        else:
            raise FileNotFoundError(f"{self.dir}: no {SINGLE} or {INDEX}")
        self.weight_map = weight_map
        self._files: dict[str, Any] = {}

    @property
    def names(self) -> set[str]:
        """Every tensor name in the checkpoint, as stored (with any prefix)."""
        return set(self.weight_map)

    def _slice(self, name: str) -> Any:
        from safetensors import safe_open

        stored = self.prefix + name
        if stored not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {stored!r} not in the checkpoint")
        file = self.weight_map[stored]
        if file not in self._files:
            self._files[file] = safe_open(self.dir / file, "pt")
        return self._files[file].get_slice(stored)

    def get(self, name: str) -> Tensor:
        return self._slice(name)[:]

    def get_index(self, name: str, index: int) -> Tensor:
        return self._slice(name)[index]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def close(self) -> None:
        self._files.clear()


def parse_size(text: str | int) -> int:
    """`5GB`, `500MB`, `2GiB` or a byte count (transformers' `max_shard_size` units: GB = 10^9)."""
    if isinstance(text, int):
        return text
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    upper = text.strip().upper()
    for unit, scale in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * scale)
    if upper.isdigit():
        return int(upper)
    raise ValueError(f"shard size: expected a size such as 5GB, 500MB or 2GiB, got {text!r}")


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}

Plan = list[tuple[str, tuple[int, ...], torch.dtype]]
"""Every tensor to write, (name, shape, dtype), in the order they will be added."""


class ShardedWriter:
    """safetensors shards of at most `max_shard_bytes`, named and indexed as transformers does, written
    tensor by tensor.

    The shards are cut from the plan up front, so each file's header goes first and every tensor's bytes
    go straight to disk as it is added: the writer holds no tensor. Files carry a temporary name until
    `close()`, which checks that the plan was completed.
    """

    def __init__(self, out_dir: str | Path, max_shard_bytes: int, plan: Plan) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"shard size: must be >= 1 byte, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.plan = list(plan)
        names = [name for name, _, _ in self.plan]
        if len(set(names)) != len(names):
            raise ValueError(f"export: HF tensors planned twice: {sorted({n for n in names if names.count(n) > 1})}")
        self.shards: list[list[int]] = []  # indices into the plan
        size = 0
        for index, (_, shape, dtype) in enumerate(self.plan):
            nbytes = _nbytes(shape, dtype)
            if not self.shards or (self.shards[-1] and size + nbytes > max_shard_bytes):
                self.shards.append([])
                size = 0
            self.shards[-1].append(index)
            size += nbytes
        count = len(self.shards)
        self.files = [
            self.dir / (SINGLE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors") for i in range(count)
        ]
        self.total_bytes = sum(_nbytes(shape, dtype) for _, shape, dtype in self.plan)
        self._shard_of = {index: shard for shard, indices in enumerate(self.shards) for index in indices}
        self._next = 0
        self._file: Any = None

    def _tmp(self, shard: int) -> Path:
        return self.dir / f".{self.files[shard].name}.tmp"

    def _open(self, shard: int) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for index in self.shards[shard]:
            name, shape, dtype = self.plan[index]
            nbytes = _nbytes(shape, dtype)
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
        self._file = open(self._tmp(shard), "wb")  # noqa: SIM115 (closed when the shard's last tensor is written)
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def add(self, name: str, tensor: Tensor) -> None:
        if self._next >= len(self.plan):
            raise ValueError(f"export: HF tensor {name!r} is not in the plan (all planned tensors were written)")
        planned, shape, dtype = self.plan[self._next]
        if name != planned:
            raise ValueError(f"export: expected HF tensor {planned!r} next, got {name!r}")
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"export: {name} planned as {tuple(shape)} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        shard = self._shard_of[self._next]
        if self.shards[shard][0] == self._next:
            self._open(shard)
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        self._file.write(data.numpy().data)
        if self.shards[shard][-1] == self._next:
            self._file.close()
            self._file = None
        self._next += 1

    def close(self) -> list[Path]:
        """Give the shards their final names and write the index (several shards); returns the files."""
        if self._next != len(self.plan):
            missing = [name for name, _, _ in self.plan[self._next :]]
            raise ValueError(f"export: {len(missing)} planned HF tensors were never written: {missing[:20]}")
        for shard, path in enumerate(self.files):
            self._tmp(shard).rename(path)
        if len(self.files) > 1:
            weight_map = {self.plan[i][0]: self.files[s].name for s, indices in enumerate(self.shards) for i in indices}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return self.files


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files, generation config and chat template that exist in `src`; returns their names."""
    copied = []
    for name in SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
