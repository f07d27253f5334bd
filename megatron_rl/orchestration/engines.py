"""The generator engines of a run: SGLang servers placed by Ray, one client-side balancer in the driver.

Each engine is an `EngineHost` Ray actor that owns one SGLang server process (holding `engine.tp` GPUs of
one node on a cluster, reserved by a placement group (orchestration/placement.py); one core on CPU) and
reports its URL; the driver talks to all of them over HTTP through an `EngineBalancer`. The weight-sync
group's rendezvous is on trainer rank 0's node, which hosts its store. CPU engines of a run on one machine
(`local_engines`: Ray started by the driver) have no node or GPU for Ray to choose: their servers are the
driver's own child processes (`LocalEngine`), started as soon as the starting policy is checked
(`LocalLaunch`), before Ray is up. Either way an engine is the same `SGLangServer`, started, restarted and
stopped the same way; only where its process lives differs.

A killed engine costs time, not the run:
- A request whose engine failed waits while the balancer's callback restarts that engine if its process
  is gone, re-forms the weight-sync group with it and pushes the trainer's current weights to it
  (`rollout/engine_restarts`); then the request is retried, on another engine when there is one
  (`rollout/engine_failures`, `rollout/engine_retries`).
- A weight push that fails (a dead peer fails it within seconds: refused HTTP calls, gloo's "connection
  closed by peer"; a hung one after `rollout.sync_timeout_s`, see generator/weight_sync.py) restarts the dead
  engines and the ones the failure names (a hung engine is alive but answers nothing: it is killed first, which also
  ends the trainer's pending send to it), re-forms the group and pushes once more
  (`rollout/sync_failures`); a second failure ends the run with a SyncError.

Restarts and pushes take one lock, so an engine is restarted once however many requests saw it die, and
no push runs on a group that a restart is replacing. A restarted engine loads the run's initial policy
and reports weight version 0 until the push that follows the restart, so tokens it generates in between
(only requests that reach it in the seconds between its restart and that push) carry version 0: they
are labeled with the policy that really produced them, and the staleness rule (rollout/pipeline.py)
counts them as old: with `rollout.staleness: wait` (the default) the trainer takes their group as a due
one, with `drop` it drops the group once more than k versions old. The catch-up push sends the trainer's
current weights to every engine, so in PPO-off-policy mode a restart mid-round moves the round to the newer
policy (the tokens say so).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

from megatron_rl.config import EngineConfig, RunConfig, SamplingConfig
from megatron_rl.generator.balancer import EngineBalancer
from megatron_rl.generator.client import SGLangClient, SyncError
from megatron_rl.generator.server import SGLangServer
from megatron_rl.orchestration.placement import Placed, Placement, describe, engine_placement, locations, spawn
from megatron_rl.rollout.types import RoutingShape


class EngineHost(Placed):
    """One SGLang server inside a Ray actor (so Ray decides which node and GPUs it gets)."""

    def setup(self, model_path: str, engine: dict[str, Any], log_path: str, context_length: int) -> None:
        import ray

        from megatron_rl.config import build

        host = ray.util.get_node_ip_address()
        self.server = engine_server(Path(model_path), build(EngineConfig, engine), Path(log_path), context_length, host)

    async def start(self) -> str:
        self.server.start()
        await self.server.wait_ready()
        return self.server.url

    async def restart(self, kill: bool = False) -> str:
        """Stop (at once with SIGKILL when `kill`: a hung server would ignore SIGTERM) and start again."""
        await self.server.restart(grace_s=0.0 if kill else 20.0)
        return self.server.url

    def alive(self) -> bool:
        return self.server.alive()

    def stop(self) -> None:
        self.server.stop()


def engine_server(model: Path, engine: EngineConfig, log: Path, context_length: int, host: str) -> SGLangServer:
    """The server of one engine. The KV pool: SGLang sizes it from the memory fraction on GPUs; on CPU the server's
    own default (generator/server.py, CPU_DEFAULT_MAX_TOTAL_TOKENS) caps it in tokens."""
    return SGLangServer(model, engine, log, host=host, context_length=context_length)


def local_engines(run: RunConfig) -> bool:
    """CPU engines of a run on one machine (Ray started by the driver, no RAY_ADDRESS) are the driver's own child
    processes: Ray has no node or GPU to choose for them, and each would cost an actor process (~90 MB, ~1 s of
    CPU) between Ray's start and the server's, on the start-up's critical path."""
    return run.rollout.engine.device == "cpu" and not os.environ.get("RAY_ADDRESS")


class LocalLaunch:
    """The servers of `local_engines`, started as soon as the starting policy is known and checked (from the thread
    that prepares the run's inputs, before Ray is up), so their imports overlap the rest of the start-up; the
    `EngineGroup` then waits for them to be ready. `close` stops them if the start fails before that."""

    def __init__(self, run: RunConfig, run_dir: Path) -> None:
        self.run, self.run_dir = run, run_dir
        self.servers: list[SGLangServer] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self, policy: Path) -> None:
        engine, logs = with_routing(self.run), self.run_dir / "logs"
        with self._lock:
            if self._closed:  # the start failed meanwhile
                return
            self.servers = [
                engine_server(policy, engine, logs / f"engine{i}.log", self.run.rollout.context_length, "127.0.0.1")
                for i in range(engine.num_engines)
            ]
            for server in self.servers:
                server.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for server in self.servers or []:
                server.stop(grace_s=5.0)


def with_routing(run: RunConfig) -> EngineConfig:
    """The run's engine settings; with MoE routing replay every answer carries its routing record. On GPUs the MoE
    runner is pinned to Triton's fused MoE unless `extra_args` names one: SGLang 0.5.23 captures routed experts only
    on its default top-k path, and its `auto` choice takes flashinfer_trtllm (which skips the capture and leaves
    every record 0) for unquantized MoE on Blackwell; the client refuses such records (RoutingShape.check_captured)."""
    engine = run.rollout.engine
    if run.algo.routing_replay != "none":
        extra = [*engine.extra_args, "--enable-return-routed-experts"]
        if engine.device == "cuda" and not any(a.startswith("--moe-runner-backend") for a in engine.extra_args):
            extra += ["--moe-runner-backend", "triton"]
        engine = dataclasses.replace(engine, extra_args=extra)
    return engine


class RemoteEngine:
    """An engine on an `EngineHost` actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def start(self) -> str:
        return str(await self.actor.start.remote())

    async def restart(self, kill: bool) -> str:
        return str(await self.actor.restart.remote(kill=kill))

    async def alive(self) -> bool:
        return bool(await self.actor.alive.remote())

    async def stop(self) -> None:
        await self.actor.stop.remote()


class LocalEngine:
    """An engine whose server is the driver's child process (`local_engines`), started by `LocalLaunch`."""

    def __init__(self, server: SGLangServer) -> None:
        self.server = server

    async def start(self) -> str:
        await self.server.wait_ready()
        return self.server.url

    async def restart(self, kill: bool) -> str:
        await self.server.restart(grace_s=0.0 if kill else 20.0)
        return self.server.url

    async def alive(self) -> bool:
        return self.server.alive()

    async def stop(self) -> None:
        await asyncio.to_thread(self.server.stop)


class EngineGroup:
    """The run's engines: start, generate (balanced, with retries), weight sync, restarts, metrics."""

    def __init__(self, run: RunConfig, policy: Path, run_dir: Path, servers: list[SGLangServer] | None = None) -> None:
        """`servers`: the run's local engines, started by `LocalLaunch`; otherwise one `EngineHost` actor each."""
        import ray

        self.run = run
        engine = with_routing(run)
        self.routing: RoutingShape | None = None
        if run.algo.routing_replay != "none":
            moe = run.model.moe
            assert moe.num_experts is not None
            self.routing = RoutingShape(run.model.num_layers, moe.router_topk, moe.num_experts)
        self.placement: Placement | None = None
        self.hosts: list[LocalEngine | RemoteEngine]
        if servers is not None:
            self.hosts = [LocalEngine(server) for server in servers]
        else:
            self.placement = engine_placement(run)
            actors = spawn(EngineHost, self.placement)
            config, logs = dataclasses.asdict(engine), run_dir / "logs"
            ray.get(
                [
                    h.setup.remote(str(policy), config, str(logs / f"engine{i}.log"), run.rollout.context_length)
                    for i, h in enumerate(actors)
                ]
            )
            if self.placement.groups:
                print(f"placement: engines {describe(locations(actors))}", flush=True)
            self.hosts = [RemoteEngine(actor) for actor in actors]
        self.devices = engine.num_engines * engine.tp
        self.clients: list[SGLangClient] = []
        self.balancer: EngineBalancer | None = None
        self.restarts = 0
        self.sync_failures = 0
        self.resync = False
        """True when the trainer's sync group lacks a (restarted) engine: re-form it before the next push."""
        self.trainers: Any = None
        """The TrainerGroup that pushes weights (set by connect_weight_sync); restarts catch up from it."""
        self._lock = asyncio.Lock()  # held by a restart (with its catch-up push) and by a push

    async def start(self) -> None:
        urls = await asyncio.gather(*(host.start() for host in self.hosts))
        self.clients = [SGLangClient(url, tp=self.run.rollout.engine.tp, routing=self.routing) for url in urls]
        self.balancer = EngineBalancer(self.clients, self.run.rollout.sampling, self.run.rollout.max_retries)
        self.balancer.on_failure = self._on_failure

    async def generate(
        self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], sampling: SamplingConfig | None = None
    ) -> Any:
        assert self.balancer is not None, "EngineGroup.start() first"
        return await self.balancer(input_ids, max_new_tokens, stop_ids, sampling)

    async def _on_failure(self, client: SGLangClient) -> None:
        """A request failed on `client`: restart its engine if it died and give it the current weights
        before the request is retried (requests that saw the same death wait here, then find it running)."""
        async with self._lock:
            if await self._restart_if_dead(self.clients.index(client)) and self.trainers is not None:
                await self._push(self.trainers, "catch-up after a restart")

    async def _restart_if_dead(self, index: int, hung: bool = False) -> bool:
        """Restart engine `index` if its server process is gone, or kill and restart it if `hung` (lock held);
        True if it was restarted.

        The process, not `/health`, decides: SGLang answers `/health` with a one-token generation, which a
        busy or paused (mid-push) engine may not finish within the probe's timeout. Only a weight push, with
        its deadline on every step, calls an engine hung."""
        if not hung and await self.hosts[index].alive():
            return False  # a transient error, or another caller already restarted it
        print(f"engine {index} {'did not answer a weight push' if hung else 'died'}; restarting it", flush=True)
        self.clients[index].url = await self.hosts[index].restart(kill=hung)
        self.restarts += 1
        self.resync = True
        return True

    async def connect_weight_sync(self, trainers: Any) -> None:
        """Trainer rank 0 forms a weight-sync process group with every engine."""
        self.trainers = trainers
        urls = [c.url for c in self.clients]
        addr, port = await trainers.rendezvous()  # rank 0 hosts the group's store: its node, not the driver's
        await trainers.call("init_weight_sync", urls, addr, port)

    async def push_weights(self, trainers: Any, version: int) -> dict[str, float]:
        """Send the trainer's weights (version `version`) to every engine; returns sync/* metrics."""
        async with self._lock:
            return await self._push(trainers, f"version {version}")

    async def _push(self, trainers: Any, what: str) -> dict[str, float]:
        """One push (lock held); after a failure restart the dead engines, re-form the group, push once more."""
        try:
            if self.resync:
                await self._reconnect(trainers)
            return await trainers.call("push_weights")
        except SyncError as exc:
            self.sync_failures += 1
            self.resync = True  # the group saw a failure: rebuild it whatever the cause
            named = set(getattr(getattr(exc, "cause", None) or exc, "engines", []))
            print(f"weight push ({what}) failed: {_cause(exc)}; restarting dead engines and pushing again", flush=True)
        restarted = [i for i in range(len(self.hosts)) if await self._restart_if_dead(i, hung=i in named)]
        try:
            await self._reconnect(trainers)
            return await trainers.call("push_weights")
        except SyncError as exc:
            raise SyncError(
                f"weight push ({what}) failed twice: a retry after restarting engines {restarted} and re-forming "
                f"the sync group failed too: {_cause(exc)}"
            ) from exc

    async def _reconnect(self, trainers: Any) -> None:
        await trainers.call("close")
        await self.connect_weight_sync(trainers)
        self.resync = False

    def reset_usage(self) -> None:
        """Start the engines' busy/idle accounting now (after start-up)."""
        if self.balancer is not None:
            self.balancer.reset_usage()

    def metrics(self) -> dict[str, float]:
        metrics = self.balancer.metrics() if self.balancer else {}
        metrics["rollout/engine_restarts"] = float(self.restarts)
        metrics["rollout/sync_failures"] = float(self.sync_failures)
        return metrics

    async def stop(self) -> None:
        for client in self.clients:
            await client.close()
        await asyncio.gather(*(host.stop() for host in self.hosts), return_exceptions=True)
        if self.placement is not None:
            self.placement.remove()  # frees the GPUs (and ends the host actors)


def _cause(exc: BaseException) -> str:
    """The message of the error raised inside a Ray actor (a RayTaskError carries it as `cause`)."""
    return str(getattr(exc, "cause", None) or exc)
