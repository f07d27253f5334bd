"""The generator engines of a run: SGLang servers placed by Ray, one client-side balancer in the driver.

Each engine is an `EngineHost` Ray actor that owns one SGLang server process (holding `engine.tp` GPUs
on a cluster, one core on CPU) and reports its URL; the driver talks to all of them over HTTP through an
`EngineBalancer`. A request whose engine died is retried on another engine; a dead engine is restarted,
and the next weight push re-forms the sync group so it catches up (counted in `rollout/engine_restarts`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from megatron_rl.config import RunConfig
from megatron_rl.rollout.sglang import EngineBalancer, SGLangClient, SGLangServer


class EngineHost:
    """One SGLang server inside a Ray actor (so Ray decides which node and GPUs it gets)."""

    def __init__(self, model_path: str, engine: dict[str, Any], log_path: str, max_total_tokens: int | None) -> None:
        import ray

        from megatron_rl.config import EngineConfig, build

        host = ray.util.get_node_ip_address()
        self.server = SGLangServer(
            Path(model_path), build(EngineConfig, engine), Path(log_path), host=host, max_total_tokens=max_total_tokens
        )

    async def start(self) -> str:
        self.server.start()
        await self.server.wait_ready()
        return self.server.url

    async def restart(self) -> str:
        await self.server.restart()
        return self.server.url

    def alive(self) -> bool:
        return self.server.alive()

    def pid(self) -> int:
        return self.server.process.pid if self.server.process else -1

    def stop(self) -> None:
        self.server.stop()


class EngineGroup:
    def __init__(self, run: RunConfig, policy: Path, run_dir: Path) -> None:
        import dataclasses

        import ray

        self.run = run
        engine = run.rollout.engine
        cpu = engine.device == "cpu"
        actor = ray.remote(num_cpus=1 if cpu else 0, num_gpus=0 if cpu else engine.tp)(EngineHost)
        max_total = 32768 if cpu else None  # CPU: size the KV pool in tokens (no GPU memory fraction)
        self.hosts = [
            actor.remote(str(policy), dataclasses.asdict(engine), str(run_dir / "logs" / f"engine{i}.log"), max_total)
            for i in range(engine.num_engines)
        ]
        self.devices = engine.num_engines * engine.tp
        self.clients: list[SGLangClient] = []
        self.balancer: EngineBalancer | None = None
        self.restarts = 0
        self.resync = False
        self._restart_lock = asyncio.Lock()

    async def start(self) -> None:
        urls = await asyncio.gather(*(host.start.remote() for host in self.hosts))
        self.clients = [SGLangClient(url, tp=self.run.rollout.engine.tp) for url in urls]
        self.balancer = EngineBalancer(self.clients, self.run.rollout.sampling, self.run.rollout.max_retries)
        self.balancer.on_failure = self._on_failure

    async def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Any:
        assert self.balancer is not None, "EngineGroup.start() first"
        return await self.balancer(input_ids, max_new_tokens, stop_ids)

    async def _on_failure(self, client: SGLangClient) -> None:
        index = self.clients.index(client)
        async with self._restart_lock:
            if await client.health():
                return  # a transient error, or another request already restarted it
            if await self.hosts[index].alive.remote():
                return
            print(f"engine {index} died; restarting it", flush=True)
            client.url = await self.hosts[index].restart.remote()
            self.restarts += 1
            self.resync = True

    async def connect_weight_sync(self, trainers: Any) -> None:
        import ray

        from megatron_rl.trainer.distributed import free_port

        urls = [c.url for c in self.clients]
        await trainers.call("init_weight_sync", urls, ray.util.get_node_ip_address(), free_port())

    async def push_weights(self, trainers: Any, version: int) -> dict[str, float]:
        if self.resync:  # a restarted engine is not in the old group: form a new one
            await trainers.call("close")
            await self.connect_weight_sync(trainers)
            self.resync = False
        return await trainers.call("push_weights")

    def metrics(self) -> dict[str, float]:
        metrics = self.balancer.metrics() if self.balancer else {}
        metrics["rollout/engine_restarts"] = float(self.restarts)
        return metrics

    async def stop(self) -> None:
        for client in self.clients:
            await client.close()
        await asyncio.gather(*(host.stop.remote() for host in self.hosts), return_exceptions=True)
