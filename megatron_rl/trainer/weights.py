"""Full weights out of (and into) a model sharded over TP / EP / PP, under canonical megatron names.

Canonical names are those of a TP=1, PP=1, EP=1 model built with megatron-core's local layer spec:
global layer indices (`decoder.layers.{i}`), global expert indices (`...experts.local_experts.{e}`),
and the norms of Transformer Engine's fused linears renamed to their local-spec names. convert/ maps
canonical names to Hugging Face names; weight sync and export both go through here.

    for bucket in iter_full_weights(model, bucket_bytes):     # every trainer rank iterates, in step
        for name, tensor in bucket: ...                        # full tensors, on every rank
    load_full_weights(model, named_tensors)                    # each rank keeps its shard

Gathering is lazy, one parameter at a time, so peak extra memory is one full parameter (plus one bucket):
- TP: shards concatenated along the parameter's partition dim; the fused gate/up `linear_fc1` of a gated
  MLP is split per shard and re-joined as [gate; up];
- EP: every expert-parallel rank's local experts all-gathered and renumbered globally;
- PP: each stage's tensors broadcast to the other stages of the same pipeline.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
_TE_RENAMES = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}


@dataclass
class _Entry:
    local_name: str
    param: Tensor
    layer_offset: int


def _parallel() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _canonical(local_name: str, layer_offset: int, expert_offset: int) -> str:
    name = local_name
    for old, new in _TE_RENAMES.items():
        name = name.replace(old, new)
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return _EXPERT.sub(lambda m: f".experts.local_experts.{int(m.group(1)) + expert_offset}.", name)


def _is_glu_fc1(name: str, model: Any) -> bool:
    return name.endswith("linear_fc1.weight") and bool(model.config.gated_linear_unit)


def _join_tp(shards: list[Tensor], dim: int, glu: bool) -> Tensor:
    if glu:  # each shard is [gate_i; up_i]
        halves = [s.chunk(2, dim=dim) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(shards, dim)


def _split_tp(full: Tensor, dim: int, size: int, rank: int, glu: bool) -> Tensor:
    if glu:
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim)[rank], up.chunk(size, dim)[rank]], dim)
    return full.chunk(size, dim)[rank]


def _all_gather(tensor: Tensor, group: Any) -> list[Tensor]:
    out = [torch.empty_like(tensor) for _ in range(_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def _entries(model: Any) -> list[_Entry]:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(model.config)
    return [_Entry(name, param, offset) for name, param in model.named_parameters()]


def _is_expert(name: str) -> bool:
    return ".experts.local_experts." in name


def _full_tensors(model: Any, entry: _Entry) -> list[tuple[str, Tensor]]:
    """Collective within this rank's stage: the entry's full tensor(s) under canonical names."""
    ps = _parallel()
    param = entry.param.detach()
    expert = _is_expert(entry.local_name)
    tp_group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    if getattr(entry.param, "tensor_model_parallel", False) and _size(tp_group) > 1:
        glu = _is_glu_fc1(entry.local_name, model)
        param = _join_tp(_all_gather(param, tp_group), entry.param.partition_dim, glu)
    if not expert:
        return [(_canonical(entry.local_name, entry.layer_offset, 0), param)]
    ep_group = ps.get_expert_model_parallel_group()
    num_local = model.config.num_moe_experts // _size(ep_group)
    pieces = _all_gather(param, ep_group) if _size(ep_group) > 1 else [param]
    return [(_canonical(entry.local_name, entry.layer_offset, r * num_local), p) for r, p in enumerate(pieces)]


def iter_full_weights(model: Any, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, Tensor]]]:
    """Buckets of (canonical name, full tensor); every trainer rank must iterate to the end."""
    ps = _parallel()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_size, pp_rank = _size(pp_group), ps.get_pipeline_model_parallel_rank()
    entries = _entries(model)
    if pp_size > 1:  # every stage learns the others' (names, shapes, dtypes) after gathering
        mine = [[(n, tuple(t.shape), t.dtype) for n, t in _full_tensors(model, e)] for e in entries]
        stages: list[Any] = [None] * pp_size
        dist.all_gather_object(stages, mine, group=pp_group)
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for stage in range(pp_size):
        stage_entries = entries if stage == pp_rank else [None] * len(stages[stage])
        for index, entry in enumerate(stage_entries):
            if pp_size == 1:
                tensors = _full_tensors(model, entry)
            else:
                tensors = _full_tensors(model, entry) if entry is not None else []
                received = []
                for k, (name, shape, dtype) in enumerate(stages[stage][index]):
                    buffer = tensors[k][1].contiguous() if tensors else torch.empty(shape, dtype=dtype)
                    if buffer.device.type != "cpu" or torch.cuda.is_available():
                        buffer = buffer.to(torch.cuda.current_device())
                    dist.broadcast(buffer, src=dist.get_global_rank(pp_group, stage), group=pp_group)
                    received.append((name, buffer))
                tensors = received
            for name, tensor in tensors:
                bucket.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
    if bucket:
        yield bucket


def load_full_weights(model: Any, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy full canonical tensors into this rank's shards; every parameter must be given exactly once.

    Tensors of other pipeline stages or other ranks' experts are skipped; names that belong to no rank
    at all, missing names and shape mismatches raise with the names listed.
    """
    ps = _parallel()
    expected: dict[str, tuple[Tensor, str]] = {}
    ep_size, ep_rank = _size(ps.get_expert_model_parallel_group()), ps.get_expert_model_parallel_rank()
    num_local = (model.config.num_moe_experts or 0) // ep_size if model.config.num_moe_experts else 0
    for entry in _entries(model):
        name = _canonical(entry.local_name, entry.layer_offset, ep_rank * num_local)
        expected[name] = (entry.param, entry.local_name)
    all_layers = model.config.num_layers
    seen: set[str] = set()
    unknown, mismatched = [], []
    for name, full in named_tensors:
        if name not in expected:
            layer = _LAYER.match(name)
            expert = _EXPERT.search(name)
            belongs_elsewhere = (layer is not None and int(layer.group(1)) < all_layers) or (
                expert is not None and int(expert.group(1)) < (model.config.num_moe_experts or 0)
            )
            if not belongs_elsewhere and not name.startswith(("embedding.", "output_layer.", "decoder.final_")):
                unknown.append(name)
            continue
        param, local_name = expected[name]
        expert = _is_expert(local_name)
        tp_group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        shard = full
        if getattr(param, "tensor_model_parallel", False) and _size(tp_group) > 1:
            glu = _is_glu_fc1(local_name, model)
            shard = _split_tp(full, param.partition_dim, _size(tp_group), dist.get_rank(tp_group), glu)
        if tuple(shard.shape) != tuple(param.shape):
            mismatched.append(
                f"{name} (expected shard {tuple(param.shape)}, got {tuple(shard.shape)} from {tuple(full.shape)})"
            )
            continue
        with torch.no_grad():
            param.copy_(shard.to(param.dtype))
        seen.add(name)
    missing = sorted(set(expected) - seen)
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unknown:
        problems.append(f"unexpected tensors: {sorted(unknown)}")
    if mismatched:
        problems.append(f"shape mismatches: {mismatched}")
    if problems:
        raise ValueError("load_full_weights: " + "; ".join(problems))


def iter_hf_weights(model: Any, cfg: Any, bucket_bytes: int = 512 << 20) -> Iterator[list[tuple[str, Tensor]]]:
    """`iter_full_weights` under Hugging Face names (weight sync to the engines, export)."""
    from megatron_rl.convert import to_hf

    for bucket in iter_full_weights(model, bucket_bytes):
        yield [pair for name, tensor in bucket for pair in to_hf(name, tensor, cfg)]
