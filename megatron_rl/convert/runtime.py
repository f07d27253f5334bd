"""The converter's megatron processes: one rank of a layout in this process, or all of them spawned here.

    with megatron_process(parallel):       # joins the existing process group (torchrun) or makes a
        ...                                # single-process one; tears down only what it created
    spawn(fn, parallel, *args)             # run fn(*args) in parallel.trainer_devices local processes

The trainer itself never uses these: it owns its process group (trainer/distributed.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config import ParallelConfig


def _layout_in_use() -> tuple[int, int, int] | None:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
    )


@contextmanager
def megatron_process(parallel: ParallelConfig, seed: int = 0, moe: bool = False) -> Iterator[None]:
    """This process as one rank of `parallel`'s TP/PP/EP layout, for the duration of the block (`moe`: the
    model has experts, which sets the default expert-TP size)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from megatron_rl.ports import free_port
    from megatron_rl.trainer.distributed import init_distributed, process_group_backend

    created_group = not dist.is_initialized()
    if created_group and parallel.trainer_devices == 1:  # a plain process: do not read RANK/WORLD_SIZE
        backend = process_group_backend(torch.cuda.is_available())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    in_use = _layout_in_use()
    wanted = (parallel.tp, parallel.pp, parallel.ep)
    if in_use is not None and in_use != wanted:
        raise ValueError(
            f"layout mismatch: this process already runs megatron with tp/pp/ep={in_use}, the request is "
            f"tp/pp/ep={wanted}"
        )
    init_distributed(parallel, seed, moe)
    destroy_moe_metrics_tracker()  # process-global and sized by the first MoE model built
    try:
        yield
    finally:
        destroy_moe_metrics_tracker()
        if in_use is None:
            ps.destroy_model_parallel()
        if created_group:
            dist.destroy_process_group()


def _entry(local_rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if not torch.cuda.is_available():  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    fn(*args)


def spawn(fn: Callable[..., Any], parallel: ParallelConfig, *args: Any) -> None:
    """Run `fn(*args)` as the `parallel.trainer_devices` ranks of a local process group (gloo or NCCL)."""
    import torch.multiprocessing as mp

    from megatron_rl.ports import free_port

    world = parallel.trainer_devices
    try:
        mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
    except mp.ProcessRaisedException as exc:  # the rank's traceback is in the message; keep its last line
        last = str(exc).strip().splitlines()[-1]
        raise RuntimeError(f"a spawned rank failed: {last}") from exc
