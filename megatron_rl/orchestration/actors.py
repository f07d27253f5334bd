"""Trainer ranks as Ray actors, one per device, driven together by `TrainerGroup`.

    group = TrainerGroup(run)            # N actors (N = parallel.trainer_devices), one process group
    await group.call("train_step", groups)   -> rank 0's result

Every trainer collective (train step, weight gathering, checkpointing) needs all ranks at once, so
`call` invokes the method on every actor and returns rank 0's answer. On a GPU cluster each actor holds
one GPU, ranks packed node by node in rank order (orchestration/placement.py); rank 0 hosts the
rendezvous store of the trainer's process group and of the weight-sync group, on its own node. On CPU each
actor holds one core.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from megatron_rl.config import RunConfig, build
from megatron_rl.orchestration.placement import Placed, describe, rank_order, spawn, trainer_placement
from megatron_rl.trainer import quiet_megatron


class TrainerWorker(Placed):
    """One trainer rank inside a Ray actor: placed first, then given its rank (`setup`) once all are placed."""

    def setup(self, run: dict[str, Any], rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        """Join the trainer's process group as `rank` and build the model (blocks until every rank joins)."""
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port)
        )
        # Packed rows vary in length from step to step: without expandable segments the caching allocator
        # fragments into blocks of every size (read at the first CUDA allocation, which comes after this).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        # NVLink SHARP buffers cost ~1 GiB per communicator (plan.py NVLS_GIB), more than a run planned to within a
        # few GiB of the device can spare; a site that wants them sets NCCL_NVLS_ENABLE=1 and plans with it.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        quiet_megatron()
        import torch

        from megatron_rl.trainer.step import Trainer

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.run = build(RunConfig, run)
        self.trainer = Trainer(self.run)
        self.rank = rank
        self.sender: Any = None

    def version(self) -> int:
        return self.trainer.version

    def load_hf(self, hf_dir: str) -> None:
        """Start from a Hugging Face checkpoint (each rank loads its shard)."""
        from megatron_rl.convert import load_hf_into_model

        load_hf_into_model(self.trainer.model, self.run.model, Path(hf_dir))
        self.trainer.optimizer.reload_model_params()

    def train_step(self, groups: list[Any]) -> dict[str, float]:
        return self.trainer.train_step(groups)

    def save(self, root: str, run_state: dict[str, Any], keep_last: int) -> str:
        from megatron_rl.trainer.checkpoint import save_checkpoint

        return str(save_checkpoint(self.trainer, Path(root), run_state, keep_last))

    def load(self, path: str) -> dict[str, Any]:
        from megatron_rl.trainer.checkpoint import load_checkpoint

        return load_checkpoint(self.trainer, Path(path))

    def fork(self, path: str) -> None:
        """Start a new run from the weights of checkpoint `path` (any layout): fresh optimizer state, step 0."""
        from megatron_rl.trainer.checkpoint import load_checkpoint

        load_checkpoint(self.trainer, Path(path), model_only=True)
        self.trainer.step = self.trainer.skipped_steps = 0

    def init_weight_sync(self, engine_urls: list[str], master_addr: str, master_port: int) -> None:
        """Rank 0 joins a weight-update group with the engines (gloo on CPU, NCCL on GPUs)."""
        if self.rank == 0:
            from megatron_rl.generator.weight_sync import WeightSender

            self.sender = WeightSender(engine_urls, master_addr, master_port, self.run.rollout)
            self.sender.connect()

    def push_weights(self) -> dict[str, float]:
        """Gather the full weights under HF names (all ranks) and send them to the engines (rank 0)."""
        import torch

        from megatron_rl.trainer.weights import iter_hf_weights

        engine_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(self.run.rollout.engine.dtype)
        bucket_bytes = self.run.rollout.sync_bucket_mb << 20
        buckets = iter_hf_weights(
            self.trainer.model, self.run.model, bucket_bytes, dtype=engine_dtype, dst=0, engine=True
        )
        if self.rank != 0:
            for _ in buckets:  # take part in the gathers (rank 0 alone receives the tensors)
                pass
            return {}
        try:
            return self.sender.send(buckets, version=self.trainer.version)
        except Exception:
            # The other ranks are still in the gathers of the remaining buckets: finish them, or a failed
            # push (a dead engine) would leave them blocked in a collective the driver's retry then waits on.
            for _ in buckets:
                pass
            raise

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class TrainerDied(RuntimeError):
    """A trainer rank's actor died."""

    def __init__(self, rank: int, method: str, cause: BaseException) -> None:
        reason = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        super().__init__(f"trainer rank {rank} died during {method}: {reason}")
        self.rank = rank


class TrainerGroup:
    def __init__(self, run: RunConfig, run_dict: dict[str, Any], wait: bool = True) -> None:
        """Place and start the ranks; with `wait=False` their set-up (megatron's import, the process group, the
        model) goes on in the background until `ready()`, so the engines can start meanwhile."""
        import ray

        self.placement = trainer_placement(run)
        self.workers, self.locations = rank_order(spawn(TrainerWorker, self.placement))
        # Rank 0 hosts the process group's TCP store: its node's address and a port free there, not the driver's.
        addr, port = ray.get(self.workers[0].rendezvous.remote())
        world = len(self.workers)
        self._setting_up = [w.setup.remote(run_dict, rank, world, addr, port) for rank, w in enumerate(self.workers)]
        if self.placement.groups:
            print(f"placement: trainer ranks {describe(self.locations)}; rendezvous {addr}:{port}", flush=True)
        if wait:
            ray.get(self._setting_up)

    async def ready(self) -> None:
        """Every rank set up (its model built): raises what a rank's set-up raised."""
        await asyncio.gather(*self._setting_up)

    async def rendezvous(self) -> tuple[str, int]:
        """Rank 0's node address and a port free there (rank 0 hosts the weight-sync group's store too)."""
        return await self.workers[0].rendezvous.remote()

    async def call(self, method: str, *args: Any) -> Any:
        """`method` on every rank; rank 0's result. A rank whose actor died (killed, its node lost, OOM)
        raises TrainerDied at once: the driver does not wait on the other ranks, which may be blocked in a
        collective with the dead one (they are killed with the group)."""
        import ray

        async def one(rank: int, worker: Any) -> Any:
            try:
                return await getattr(worker, method).remote(*args)
            except ray.exceptions.RayActorError as exc:
                raise TrainerDied(rank, method, exc) from exc

        results = await asyncio.gather(*(one(rank, w) for rank, w in enumerate(self.workers)))
        return results[0]

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.placement.remove()
