"""Process groups for the trainer: torch.distributed (NCCL on GPUs, gloo on CPU) and megatron's parallel state.

A trainer rank learns its place from the usual environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
`MASTER_PORT`, as set by torchrun, Ray actors or Slurm), or runs alone when none is set.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_rl.config import ParallelConfig
from megatron_rl.ports import free_port


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    ep_rank: int
    dp_rank: int
    device: torch.device


def process_group_backend(cuda: bool) -> str:
    """The default group's backend: NCCL for CUDA tensors and gloo for CPU ones on GPU nodes.

    The trainer's bookkeeping (metric sums, micro-batch counts, the finite-step vote, all_gather_object)
    reduces small CPU tensors. With "nccl" alone torch raises "No backend type associated with device type
    cpu" on the first of them; megatron's groups are created with the default backend, so they serve both
    device types too. (torch's documented multi-backend spelling, `init_process_group(backend=...)`.)
    """
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def served_device_types(backend: str) -> set[str]:
    """Device types a group with this backend string serves ("cpu:gloo,cuda:nccl" -> {"cpu", "cuda"})."""
    if ":" in backend:
        return {part.split(":")[0] for part in backend.split(",")}
    return {"nccl": {"cuda"}, "gloo": {"cpu", "cuda"}, "fake": {"cpu", "cuda"}}.get(backend, set())


def init_distributed(parallel: ParallelConfig, seed: int, moe: bool = False, timeout_s: float = 1800.0) -> RankInfo:
    """Join (or create) the trainer's process group and megatron's TP/CP/PP/EP/ETP/DP groups; idempotent.

    `moe`: whether the model has experts (the default expert-TP size depends on it, `ParallelConfig.etp`).
    `timeout_s`: every group's collective timeout (`RunConfig.collective_timeout_s`).
    """
    from megatron.core import parallel_state, tensor_parallel

    from megatron_rl.trainer import cpu_compat

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", 0)) or free_port()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        dist.init_process_group(
            process_group_backend(cuda),
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    world_size = dist.get_world_size()
    if world_size != parallel.trainer_devices:
        raise ValueError(
            f"parallel.trainer_devices: {parallel.trainer_devices} but the process group has {world_size} ranks"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.expert_tp(moe),
            distributed_timeout_minutes=math.ceil(timeout_s / 60),
        )
    cpu_compat.apply()
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return RankInfo(
        rank=dist.get_rank(),
        world_size=world_size,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        device=torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
    )


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
