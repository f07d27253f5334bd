"""What a run checks of a Hugging Face checkpoint directory without torch: config.json against the model config and
every weight file's safetensors header. The driver of `megatron-rl train` runs it on `model.hf_path` before anything
starts (orchestration/warmstart.py); the tensors' names and shapes, which need the family mappings on meta tensors,
are checked where torch already is: `megatron-rl check`, every trainer rank's import (convert/hf_import.py) and a
driver whose engines failed to start (an engine loading a misshapen tensor dies on a bare assertion), with the same
messages. Importing torch in the driver would hold ~140 MiB there for the whole run.

    index = verify_hf_files(cfg, hf_dir)      # ValueError naming the file, field or dimension that differs
    index = HeaderIndex(hf_dir)               # every tensor's name and shape from the files' headers alone
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from megatron_rl.config import ModelConfig
from megatron_rl.models import FAMILIES, family, family_of, hf_configs, read_hf_config

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def verify_hf_files(cfg: ModelConfig, hf_dir: str | Path) -> HeaderIndex:
    """config.json's architecture and dimensions against `cfg`, then every weight file present, with a readable
    header and as long as its header says (nothing is loaded). Raises ValueError naming what differs."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"{hf_dir} has no config.json (not a Hugging Face checkpoint directory)")
    family(cfg).check(cfg)
    check_config_json(cfg, hf_dir)
    return HeaderIndex(hf_dir)


def check_config_json(cfg: ModelConfig, hf_dir: Path) -> None:
    """config.json (when present) must describe the model being loaded."""
    if not (hf_dir / "config.json").exists():
        return
    hf = read_hf_config(hf_dir)
    name = family_of(hf)
    if name != cfg.family:
        raise ValueError(f"{hf_dir}: config.json is a {name} model, model.family is {cfg.family!r}")
    diffs = hf_configs.differences(cfg, FAMILIES[name].model_config(hf, cfg.name))
    if diffs:
        raise ValueError(f"{hf_dir}: config.json disagrees with the model config: {'; '.join(diffs)}")


class HeaderIndex:
    """The tensors of an HF checkpoint directory as its safetensors headers list them, read without loading anything
    (the 8-byte header length and the JSON header of each file), with every weight file checked: present, a readable
    header, and as long as the header says its data is. A copy cut short, a shard missing from the index or a
    directory without weights raises ValueError naming the file. Same face as HFReader for the name and shape
    checks (`names`, `prefix`, `shape`, `dir`)."""

    def __init__(self, hf_dir: str | Path, prefix: str = "") -> None:
        self.dir = Path(hf_dir)
        self.prefix = prefix
        if (self.dir / INDEX).is_file():
            try:
                weight_map: dict[str, str] = json.loads((self.dir / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{self.dir / INDEX}: not a safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE).is_file():
            files, weight_map = [SINGLE], {}
        elif any(self.dir.glob("*.bin")) or any(self.dir.glob("*.pth")):
            raise ValueError(f"{self.dir}: only safetensors checkpoints are read; convert the .bin/.pth files first")
        else:
            raise ValueError(f"{self.dir}: no weights ({SINGLE} or {INDEX})")
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.nbytes = 0
        """Bytes of all weight files."""
        for file in files:
            for name, shape in _header_shapes(self.dir / file).items():
                if weight_map and weight_map.get(name) != file:
                    raise ValueError(f"{self.dir / file}: holds {name}, which {INDEX} places in {weight_map.get(name)}")
                self._shapes[name] = shape
            self.nbytes += (self.dir / file).stat().st_size
        unlisted = sorted(set(weight_map) - set(self._shapes))
        if unlisted:
            raise ValueError(f"{self.dir}: {INDEX} lists {len(unlisted)} tensors no file holds: {unlisted[:5]}")
        self.files = files

    @property
    def names(self) -> set[str]:
        return set(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[self.prefix + name]


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from one safetensors file's header; ValueError if the file is missing, its header
    unreadable, or it is shorter than its tensors' data."""
    if not path.is_file():
        raise ValueError(f"{path}: weight file missing")
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + length + end > size:
        raise ValueError(f"{path}: {size} bytes, but its header describes {8 + length + end}: the file is cut short")
    return {name: tuple(entry["shape"]) for name, entry in header.items()}
