"""Full weights out of (and into) a model sharded over TP / EP / PP, under canonical megatron names.

Canonical names are those of a TP=1, PP=1, EP=1 model built with megatron-core's local layer spec:
global layer indices (`decoder.layers.{i}`), global expert indices (`...experts.local_experts.{e}`), the
norms of Transformer Engine's fused linears under their local-spec names (`input_layernorm.weight`,
`pre_mlp_layernorm.weight`), TE grouped-GEMM experts (`experts.linear_fc1.weight{e}`) as local experts,
and no `output_layer.weight` when the output layer shares the embedding. convert/ maps canonical names
to Hugging Face names; weight sync, import and export all go through here.

    for bucket in iter_full_weights(model, bucket_bytes):     # every trainer rank iterates to the end
        for name, tensor in bucket: ...                        # full tensors, on every rank
    load_full_weights(model, named_tensors)                    # every rank calls it; each keeps its shard

`iter_full_weights` yields the names in the order of a TP=1/PP=1/EP=1 model's `named_parameters()`,
whatever the layout. It is lazy: one parameter is made whole at a time, so the extra memory is one full
parameter plus the bucket being filled. Within a pipeline stage:
- EP: expert e lives on expert-parallel rank e // experts_per_rank as local expert e % experts_per_rank;
  that rank broadcasts it over the expert-parallel group (in global expert order);
- TP: shards are all-gathered over the (expert-)tensor-parallel group and concatenated along the
  partition dim; the fused gate/up `linear_fc1` of a gated MLP is split per shard, its shards being
  [gate_i; up_i], and re-joined as [gate; up];
and every stage's tensors are broadcast over the pipeline group, so EVERY rank receives every full tensor
(rank 0, which talks to the generators, included). Yielded tensors may share memory with the parameters:
copy what you keep past the next optimizer step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(?P<block>.*\.experts)\.local_experts\.(?P<index>\d+)\.(?P<leaf>.*)$")
_GROUPED = re.compile(r"\.experts\.linear_fc(?P<fc>[12])\.weight(?P<index>\d+)$")
_TE_RENAMES = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}
TIED_OUTPUT = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"
LIST_LIMIT = 50
"""Names listed per kind of problem in an error message (the count is always given)."""


def _parallel() -> Any:
    from megatron.core import parallel_state

    return parallel_state


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group: Any) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


@dataclass(frozen=True)
class _Shard:
    """How this rank's parameter relates to one canonical tensor."""

    name: str
    param: Tensor
    full_shape: tuple[int, ...]
    tp_group: Any
    partition_dim: int
    glu: bool
    expert_owner: int | None
    """Expert-parallel rank that holds this expert (None: not an expert)."""

    @property
    def tp_size(self) -> int:
        return _size(self.tp_group) if getattr(self.param, "tensor_model_parallel", False) else 1


def _local_name(name: str, layer_offset: int) -> str:
    """A parameter's name with TE's names normalised and its layer index made global."""
    for old, new in _TE_RENAMES.items():
        name = name.replace(old, new)
    name = _GROUPED.sub(lambda m: f".experts.local_experts.{m['index']}.linear_fc{m['fc']}.weight", name)
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


def _layer_offset(model: Any) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return int(get_transformer_layer_offset(model.config))


def _num_experts(model: Any) -> int:
    return int(model.config.num_moe_experts or 0)


def _shard(model: Any, name: str, param: Tensor, expert_owner: int | None) -> _Shard:
    ps = _parallel()
    expert = expert_owner is not None
    tp_group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    dim = int(getattr(param, "partition_dim", 0))
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[dim] *= _size(tp_group)
    glu = name.endswith("linear_fc1.weight") and bool(model.config.gated_linear_unit)
    return _Shard(name, param, tuple(shape), tp_group, dim, glu, expert_owner)


def _stage_shards(model: Any) -> list[_Shard]:
    """This stage's canonical tensors, in TP=1/EP=1 parameter order, with the local parameter behind each.

    For expert e every expert-parallel rank points at its own local expert e % experts_per_rank (same
    shape); only the owner's is sent.
    """
    ps = _parallel()
    offset = _layer_offset(model)
    ep_size = _size(ps.get_expert_model_parallel_group())
    per_rank = _num_experts(model) // ep_size if _num_experts(model) else 0
    tied_replica = model.share_embeddings_and_output_weights and not model.pre_process
    order: list[_Shard | str] = []  # parameters, and experts blocks (expanded below) where they start
    blocks: dict[str, dict[tuple[int, str], Tensor]] = {}  # experts block -> (local index, leaf) -> param
    for raw_name, param in model.named_parameters():
        name = _local_name(raw_name, offset)
        if name == TIED_OUTPUT and tied_replica:
            continue  # the last stage's copy of the (first stage's) embedding
        expert = _EXPERT.match(name)
        if expert is None:
            order.append(_shard(model, name, param, None))
            continue
        if expert["block"] not in blocks:
            blocks[expert["block"]] = {}
            order.append(expert["block"])
        blocks[expert["block"]][(int(expert["index"]), expert["leaf"])] = param
    shards: list[_Shard] = []
    for item in order:
        if isinstance(item, _Shard):
            shards.append(item)
            continue
        local = blocks[item]
        leaves = [leaf for index, leaf in local if index == 0]
        for expert_index in range(_num_experts(model)):
            owner, index = divmod(expert_index, per_rank)
            for leaf in leaves:
                name = f"{item}.local_experts.{expert_index}.{leaf}"
                shards.append(_shard(model, name, local[(index, leaf)], owner))
    return shards


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


def _whole(shard: _Shard, dtype: torch.dtype | None = None) -> Tensor:
    """Collective within the stage: the full tensor (in `dtype`, cast before it is gathered), on every rank of
    the stage."""
    ps = _parallel()
    tensor = shard.param.detach()
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if shard.expert_owner is not None:
        ep_group = ps.get_expert_model_parallel_group()
        if _size(ep_group) > 1:
            tensor = tensor.contiguous() if _rank(ep_group) == shard.expert_owner else torch.empty_like(tensor)
            dist.broadcast(tensor, src=dist.get_global_rank(ep_group, shard.expert_owner), group=ep_group)
    if shard.tp_size > 1:
        pieces = [torch.empty_like(tensor) for _ in range(shard.tp_size)]
        dist.all_gather(pieces, tensor.contiguous(), group=shard.tp_group)
        tensor = _join_tp(pieces, shard.partition_dim, shard.glu)
    return tensor


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def iter_full_weights(
    model: Any, bucket_bytes: int = 512 << 20, keep: bool = True, dtype: torch.dtype | None = None
) -> Iterator[list[tuple[str, Tensor]]]:
    """Buckets of (canonical name, full tensor), on every rank; every trainer rank must iterate to the end.

    `keep=False`: this rank takes part in the collectives but keeps nothing (it yields no bucket), so it holds
    one full tensor at a time instead of a bucket (the weight sync: only rank 0 sends). `dtype`: every shard is
    cast before it is gathered, so the gathers move and hold that dtype (an fp32 head gathered for bf16 engines
    costs half)."""
    ps = _parallel()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_size, pp_rank = _size(pp_group), _rank(pp_group)
    shards = _stage_shards(model)
    mine = [(s.name, s.full_shape, dtype or s.param.dtype) for s in shards]
    plan: list[Any] = [mine]
    if pp_size > 1:  # every stage learns the names, shapes and dtypes of the others'
        plan = [None] * pp_size
        dist.all_gather_object(plan, mine, group=pp_group)
    device = _device(model)
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for stage, entries in enumerate(plan):
        local = pp_size == 1 or stage == pp_rank
        for index, (name, shape, kind) in enumerate(entries):
            tensor = _whole(shards[index], dtype) if local else torch.empty(shape, dtype=kind, device=device)
            if pp_size > 1:
                tensor = tensor.contiguous()
                dist.broadcast(tensor, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            if not keep:
                continue
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
    if bucket:
        yield bucket


def full_shapes(model: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(canonical name, full shape, dtype) of the whole model (all stages, all experts), in order.

    Collective over the pipeline group (every rank of it must call it).
    """
    ps = _parallel()
    pp_group = ps.get_pipeline_model_parallel_group()
    mine = [(s.name, s.full_shape, s.param.dtype) for s in _stage_shards(model)]
    if _size(pp_group) == 1:
        return mine
    stages: list[Any] = [None] * _size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    return [entry for stage in stages for entry in stage]


def _listed(kind: str, names: list[str]) -> str:
    shown = names[:LIST_LIMIT]
    more = f" ... and {len(names) - LIST_LIMIT} more" if len(names) > LIST_LIMIT else ""
    return f"{len(names)} {kind}: {', '.join(shown)}{more}"


def load_full_weights(model: Any, named_tensors: Iterable[tuple[str, Tensor | Callable[[], Tensor]]]) -> None:
    """Copy full canonical tensors into this rank's shards; collective: every trainer rank calls it.

    Every rank must be given the same names (in any order); a value may be a zero-argument callable,
    called only on ranks that keep part of that tensor (so a rank reads only what it needs). Every
    canonical tensor must come exactly once. Missing names, names the model does not have, duplicates
    and shape mismatches (name, expected, got) are collected over all ranks and raised as one
    ValueError on every rank, after the tensors that did match have been copied.
    """
    ps = _parallel()
    ep_group = ps.get_expert_model_parallel_group()
    ep_rank = _rank(ep_group)
    targets: dict[str, list[_Shard]] = {}
    for shard in _stage_shards(model):
        if shard.expert_owner is None or shard.expert_owner == ep_rank:
            targets.setdefault(shard.name, []).append(shard)
    if model.share_embeddings_and_output_weights and model.post_process and not model.pre_process:
        # the last stage's copy of the tied embedding loads from the embedding
        output = model.output_layer.weight
        targets.setdefault(EMBEDDING, []).append(_shard(model, EMBEDDING, output, None))
    everything = {name for name, _, _ in full_shapes(model)}
    given: set[str] = set()
    unknown, duplicated, mismatched = [], [], []
    for name, value in named_tensors:
        if name in given:
            duplicated.append(name)
            continue
        given.add(name)
        if name not in everything:
            unknown.append(name)
            continue
        if name not in targets:
            continue  # another rank's stage or expert
        full = value() if callable(value) else value
        expected = targets[name][0].full_shape
        if tuple(full.shape) != expected:
            mismatched.append(f"{name} (expected {expected}, got {tuple(full.shape)})")
            continue
        with torch.no_grad():
            for shard in targets[name]:
                tp_rank = _rank(shard.tp_group) if shard.tp_size > 1 else 0
                piece = _split_tp(full, shard.partition_dim, shard.tp_size, tp_rank, shard.glu)
                shard.param.copy_(piece.to(device=shard.param.device, dtype=shard.param.dtype))
    missing = sorted(everything - given)
    problems = [(kind, sorted(set(names))) for kind, names in _all_ranks(unknown, duplicated, mismatched, missing)]
    message = "; ".join(_listed(kind, names) for kind, names in problems if names)
    if message:
        raise ValueError(f"load_full_weights: {message}")


def _all_ranks(unknown: list[str], duplicated: list[str], mismatched: list[str], missing: list[str]) -> list:
    kinds = ["unexpected tensors", "tensors given twice", "shape mismatches", "missing tensors"]
    mine = [unknown, duplicated, mismatched, missing]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(zip(kinds, mine, strict=True))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [(kind, [n for rank in everyone for n in rank[k]]) for k, kind in enumerate(kinds)]


def iter_hf_weights(
    model: Any,
    cfg: Any,
    bucket_bytes: int = 512 << 20,
    dtype: torch.dtype | None = None,
    dst: int | None = 0,
    engine: bool = False,
) -> Iterator[list[tuple[str, Tensor]]]:
    """`iter_full_weights` under Hugging Face names (weight sync to the engines); same collective contract.

    Only global rank `dst` receives buckets (None: every rank); the others take part in the gathers and yield
    nothing, so they build neither buckets nor Llama-4's fused expert stacks (which come out whole once their
    layer's last expert has passed). `dtype` casts each shard before it is gathered: the dtype the engines hold,
    so an fp32 LM head goes to bf16 engines in bf16 (they would round it on copy) at half the bytes and half the
    gather's memory. `engine`: the engines' weight-update names (models.to_hf(engine=True)).
    """
    from megatron_rl.models import HFMapper

    keep = dst is None or not dist.is_initialized() or dist.get_rank() == dst
    mapper = HFMapper(cfg, engine=engine)
    for bucket in iter_full_weights(model, bucket_bytes, keep=keep, dtype=dtype):
        out = [pair for name, tensor in bucket for pair in mapper.map(name, tensor)]
        if out:
            yield out
    if keep:
        mapper.finish()
