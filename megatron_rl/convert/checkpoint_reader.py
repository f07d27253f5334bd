"""Reading parts of a megatron-core distributed checkpoint (torch_dist format) in one process.

megatron-core stores each tensor under a checkpoint key by its global shape, with the layer (and expert)
index as leading axes: `decoder.layers.self_attention.linear_qkv.weight` is [layers, rows, hidden],
`decoder.layers.mlp.experts.experts.linear_fc1.weight` [layers, experts, 2 x ffn, hidden]. Whatever
TP/PP/EP layout wrote it, the stored chunks tile these global tensors, so any region can be read back
by intersecting it with the chunks; PyTorch's DCP planner helpers do exactly that.

`dist_checkpointing.load` cannot be used for a part of a layer-stacked tensor in a single process (its
conversion to torch ShardedTensors places the other shards on "rank (rank+1) % world_size", i.e. on
rank 0 again when the world is one process), hence this reader: one `torch.distributed.checkpoint.load`
per call, for exactly the regions asked, into caller-provided buffers, with no process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

Region = tuple[str, tuple[int, ...], Tensor]
"""(checkpoint key, offsets in its global tensor, destination buffer whose shape is the region's)."""


class _RegionPlanner(DefaultLoadPlanner):
    def __init__(self, regions: list[Region]) -> None:
        super().__init__()
        self.regions = regions
        self._dest: dict[tuple[str, tuple[int, ...]], Tensor] = {}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set by set_up_planner
        items: list[ReadItem] = []
        for key, offsets, dest in self.regions:
            saved = self.metadata.state_dict_metadata[key]
            assert isinstance(saved, TensorStorageMetadata), f"{key} is not a tensor in the checkpoint"
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=dest.shape)
            self._dest[(key, tuple(offsets))] = dest
            items += create_read_items_for_chunk_list(key, saved, [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        assert index.offset is not None
        return self._dest[(index.fqn, tuple(index.offset))]


class CheckpointReader:
    """Regions of the tensors of one distributed checkpoint directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata: Metadata = FileSystemReader(str(self.path)).read_metadata()

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype  # type: ignore[union-attr]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.metadata.state_dict_metadata[key].size)  # type: ignore[union-attr]

    def keys(self) -> set[str]:
        return set(self.metadata.state_dict_metadata)

    def read(self, regions: list[Region]) -> None:
        """Fill every region's buffer; raises ValueError naming a region outside its tensor."""
        for key, offsets, dest in regions:
            if key not in self.metadata.state_dict_metadata:
                raise ValueError(f"{self.path}: no tensor {key!r} in the checkpoint")
            size = self.shape(key)
            if len(offsets) != len(size) or any(o + n > s for o, n, s in zip(offsets, dest.shape, size, strict=True)):
                raise ValueError(
                    f"{self.path}: {key} has shape {size}; region at {tuple(offsets)} of {tuple(dest.shape)} "
                    "does not fit (was it saved for another model config?)"
                )
        reader: Any = FileSystemReader(str(self.path))
        dcp_load({}, storage_reader=reader, planner=_RegionPlanner(regions), no_dist=True)
