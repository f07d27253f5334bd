"""Hugging Face checkpoint directories on disk: lazy tensor reading, sharded safetensors writing, side files.

    reader = HFReader(hf_dir)                  # model.safetensors or model.safetensors.index.json
    reader.get(name); reader.get_index(name, e) # a tensor, or one slice of its first dimension
    writer = ShardedWriter(out_dir, max_shard_bytes)
    writer.add(name, tensor) ...; writer.close() # model-0000i-of-0000N.safetensors + index (or one file)
    copy_side_files(src, dst)                   # tokenizer files, generation config, chat template

Nothing here holds more than one shard: the reader memory-maps, the writer flushes a shard when the
next tensor would overflow it (a tensor larger than the limit is written alone, as transformers does).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from torch import Tensor

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
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


class ShardedWriter:
    """safetensors shards of at most `max_shard_bytes` each, named and indexed as transformers does."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int) -> None:
        if max_shard_bytes < 1:
            raise ValueError(f"shard size: must be >= 1 byte, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_shard_bytes
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"export: HF tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.dir / f".shard-{len(self._shards):05d}.safetensors.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give the shards their final names and write the index; returns the files."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        final = [
            self.dir / (SINGLE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors") for i in range(count)
        ]
        for (tmp, _), path in zip(self._shards, final, strict=True):
            tmp.rename(path)
        if count > 1:
            weight_map = {
                name: path.name for (_, names), path in zip(self._shards, final, strict=True) for name in names
            }
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return final


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the tokenizer files, generation config and chat template that exist in `src`; returns their names."""
    copied = []
    for name in SIDE_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
