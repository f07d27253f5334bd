"""Where a run's Ray actors go: trainer ranks packed per node in rank order, each engine inside one node.

    placement = trainer_placement(run)            # checks the cluster, reserves the GPUs (placement groups)
    workers, where = rank_order(spawn(TrainerWorker, placement))
    addr, port = ray.get(workers[0].rendezvous.remote())   # rank 0 hosts the store: its node, a port free there

On a GPU run (`compute.device_kind == "gpu"` for the trainer, `engine.device == "cuda"` for the engines):

- Trainer: one STRICT_PACK placement group per node, each of `gpus_per_node` bundles {GPU: 1, CPU: 1} (the
  last one smaller when the world is not a multiple of a node). A STRICT_PACK group lies on one node, and a
  full one takes all of that node's GPUs, so the groups land on distinct nodes. `rank_order` then numbers the
  ranks node by node, by GPU index inside a node: rank r is on the trainer's node r // gpus_per_node, local
  GPU r % gpus_per_node. Megatron puts TP innermost (then CP, EP, DP), so a TP group is consecutive ranks
  and stays in one node whenever tp divides gpus_per_node; so does every expert group that fits a node.
  Why not one group for the whole trainer: STRICT_PACK needs all bundles on one node (16 GPUs never fit),
  PACK and SPREAD are best-effort and may split a node's ranks over several nodes in any order, and
  STRICT_SPREAD puts one bundle per node.
- Engines: one placement group per engine with a single bundle {GPU: tp, CPU: 1}. A bundle never spans
  nodes, and the engine's Ray actor must hold all `tp` GPUs itself (its SGLang server process sees them
  through the CUDA_VISIBLE_DEVICES Ray sets for the actor; an actor cannot span bundles).
- The trainer is placed first (the driver builds `TrainerGroup` before `EngineGroup`), and both check the
  whole run against the cluster's nodes before reserving anything: a run that cannot be placed fails at
  once with what is missing. A placement group that still is not placed after `READY_TIMEOUT_S` (GPUs held
  by something else) fails the run instead of waiting forever.

On CPU runs nothing is reserved: each actor takes one CPU core, anywhere (the local Ray instance).

Limits: all GPU nodes must have the same number of GPUs (nodes without GPUs, like a CPU-only head, are
ignored); the check counts GPUs, not CPUs or memory (a node short of CPUs shows up as the timeout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config import ConfigError, RunConfig

READY_TIMEOUT_S = 30.0
"""How long placement groups may take to be placed before the run fails (seconds; placing takes well under one
on an idle cluster)."""


@dataclass(frozen=True)
class Location:
    """Where one actor runs: its Ray node, that node's IP and the node-local indices of its GPUs."""

    node_id: str
    node_ip: str
    gpus: tuple[int, ...]


class Placed:
    """Mixed into every placed actor class (trainer ranks, engine hosts): it says where it runs."""

    def location(self) -> Location:
        import ray

        gpus = tuple(sorted(int(g) for g in ray.get_gpu_ids()))
        return Location(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), gpus)

    def rendezvous(self) -> tuple[str, int]:
        """This node's IP and a TCP port free on it: the address of a process group's store hosted here."""
        import ray

        from megatron_rl.ports import free_port

        return ray.util.get_node_ip_address(), free_port("")  # every interface, as the store binds


@dataclass
class Placement:
    """Ray actor options for each actor of a group, and the placement groups that hold them (none on CPU)."""

    options: list[dict[str, Any]]
    groups: list[Any] = field(default_factory=list)

    def remove(self) -> None:
        """Release the reserved GPUs (after the group's actors are gone)."""
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)
        self.groups = []


def cpu_processes(run: RunConfig, local_engines: bool = False) -> int:
    """Ray actors of a run that each take one CPU slot (`{"num_cpus": 1}`): trainer ranks on cores, and CPU engines
    unless they are the driver's own processes (`local_engines`: a run on one machine, orchestration/engines.py)."""
    trainers = run.parallel.trainer_devices if run.compute.device_kind != "gpu" else 0
    engines = run.rollout.engine.num_engines if run.rollout.engine.device != "cuda" and not local_engines else 0
    return trainers + engines


def local_ray_cpus(run: RunConfig, cores: int) -> int:
    """CPU slots for a run's local Ray instance (its CPU engines are the driver's own processes there). A CPU run
    gets one per trainer rank, whatever the cores: Ray's CPU count only admits actors (the processes then share the
    cores; fewer slots than actors would leave the last ones pending forever), and Ray starts an idle worker
    process for every slot no actor takes (~50 MB and ~0.6 s of CPU each). A GPU run gets the machine's cores
    (each GPU bundle takes a CPU too)."""
    return cpu_processes(run, local_engines=True) or cores


def check_cpu_slots(run: RunConfig, slots: float, local_engines: bool = False) -> None:
    """Refuse a CPU run whose Ray cluster has fewer CPU slots than its actors (an external cluster): the actors
    past the last slot would wait forever, silently."""
    needed = cpu_processes(run, local_engines)
    if slots < needed:
        engines = 0 if local_engines else run.rollout.engine.num_engines
        raise ConfigError(
            f"parallel.trainer_devices / rollout.engine.num_engines: this CPU run starts {needed} processes "
            f"({run.parallel.trainer_devices} trainer ranks + {engines} engine(s)), each taking "
            f"one Ray CPU, and the Ray cluster has {slots:g}; start it with more (ray start --num-cpus={needed})"
        )


def trainer_placement(run: RunConfig, timeout_s: float = READY_TIMEOUT_S) -> Placement:
    """One option set per trainer rank, in rank order of the placement groups (see `rank_order`)."""
    world = run.parallel.trainer_devices
    if run.compute.device_kind != "gpu":
        return Placement([{"num_cpus": 1, "num_gpus": 0}] * world)
    per_node = check_cluster(run, _gpus_per_node())
    sizes = [min(per_node, world - start) for start in range(0, world, per_node)]
    groups = _reserve([[{"GPU": 1, "CPU": 1}] * size for size in sizes], f"trainer ({world} GPUs)", timeout_s)
    options = [_in_bundle(group, i, gpus=1) for group, size in zip(groups, sizes, strict=True) for i in range(size)]
    return Placement(options, groups)


def engine_placement(run: RunConfig, timeout_s: float = READY_TIMEOUT_S) -> Placement:
    """One option set per engine; on GPUs each engine's `tp` GPUs are one bundle, so on one node."""
    engine = run.rollout.engine
    if engine.device != "cuda":
        return Placement([{"num_cpus": 1, "num_gpus": 0}] * engine.num_engines)
    check_cluster(run, _gpus_per_node())
    what = f"engines ({engine.num_engines} x {engine.tp} GPUs)"
    groups = _reserve([[{"GPU": engine.tp, "CPU": 1}]] * engine.num_engines, what, timeout_s)
    return Placement([_in_bundle(group, 0, gpus=engine.tp) for group in groups], groups)


@dataclass(frozen=True)
class NodePlan:
    """How the run's GPUs fall on nodes of `per_node` GPUs, as the placement above packs them."""

    per_node: int
    trainer_gpus: int
    engines: int
    engine_tp: int
    trainer_nodes: int
    """Nodes the trainer's ranks fill in rank order (the last one possibly in part)."""
    engine_nodes: int
    """Further nodes for the engines that do not fit what the trainer's last node leaves."""

    @property
    def generator_gpus(self) -> int:
        return self.engines * self.engine_tp

    @property
    def nodes(self) -> int:
        return self.trainer_nodes + self.engine_nodes


def node_plan(run: RunConfig, nodes: int, per_node: int, where: str = "cluster") -> NodePlan:
    """The one placement rule, for a Slurm allocation (`check --allocation`, `where="allocation"`) and for a Ray
    cluster alike: raises ValueError naming the fields and the numbers when the run does not fit `nodes` x
    `per_node` GPUs (every shortfall at once).

    A TP group and an engine each stay inside one node, so parallel.tp (when the trainer spans nodes) and
    rollout.engine.tp must divide a node's GPUs; the trainer fills nodes in rank order, the engines take
    what its last node leaves, then whole nodes."""
    trainer = run.parallel.trainer_devices if run.compute.device_kind == "gpu" else 0
    engine = run.rollout.engine
    engines = engine.num_engines if engine.device == "cuda" else 0
    if trainer > per_node and per_node % run.parallel.tp:
        raise ValueError(
            f"parallel.tp={run.parallel.tp} must divide the {per_node} GPUs of a node (a TP group in one node)"
        )
    if engines and per_node % engine.tp:
        raise ValueError(
            f"rollout.engine.tp={engine.tp} must divide the {per_node} GPUs of a node (an engine in one node)"
        )
    generators, total = engines * engine.tp, nodes * per_node
    trainer_nodes = math.ceil(trainer / per_node)
    leftover = trainer_nodes * per_node - trainer  # the trainer's last node, when it is not full
    in_trainer_nodes = min(engines, leftover // engine.tp) if engines else 0
    engine_nodes = math.ceil((engines - in_trainer_nodes) / (per_node // engine.tp)) if engines else 0
    problems = []
    if trainer_nodes > nodes:
        problems.append(
            f"the trainer needs {trainer} GPUs in {trainer_nodes} nodes of {per_node} (parallel.trainer_devices); "
            f"the {where} has {nodes} node(s) with {per_node} GPUs"
        )
    if trainer + generators > total:
        problems.append(
            f"needs {trainer} trainer + {generators} generator GPUs = {trainer + generators}, "
            f"{where} has {nodes} x {per_node} = {total}"
        )
    if trainer_nodes <= nodes and trainer_nodes + engine_nodes > nodes:
        room = (nodes - trainer_nodes) * (per_node // engine.tp) + leftover // engine.tp
        problems.append(
            f"the engines need {engines} x {engine.tp} GPUs, each engine inside one node "
            f"(rollout.engine.num_engines, rollout.engine.tp); the {where} has {nodes} node(s) of {per_node} GPUs, "
            f"{trainer_nodes} of them for the trainer: room for {room} engine(s)"
        )
    if problems:
        raise ValueError("; ".join(problems))
    return NodePlan(per_node, trainer, engines, engine.tp, trainer_nodes, engine_nodes)


def check_cluster(run: RunConfig, node_gpus: Sequence[int]) -> int:
    """Whether the run's trainer and engines fit the Ray cluster's nodes (GPU counts); returns GPUs per node.

    Raises ValueError naming what is missing. Nodes without GPUs are left out; the others must be alike."""
    gpu_nodes = [n for n in node_gpus if n > 0]
    if not gpu_nodes:
        needed = run.parallel.trainer_devices if run.compute.device_kind == "gpu" else 0
        if run.rollout.engine.device == "cuda":
            needed += run.rollout.engine.num_engines * run.rollout.engine.tp
        raise ValueError(f"the run needs {needed} GPUs; the Ray cluster has none ({len(node_gpus)} node(s))")
    if len(set(gpu_nodes)) > 1:
        raise ValueError(f"the cluster's GPU nodes differ ({sorted(gpu_nodes)} GPUs); placement needs equal nodes")
    return node_plan(run, len(gpu_nodes), gpu_nodes[0]).per_node


def spawn(cls: type, placement: Placement) -> list[Any]:
    """One actor of `cls` (no constructor arguments) per option set of `placement`."""
    import ray

    actor = ray.remote(cls)
    return [actor.options(**options).remote() for options in placement.options]


def rank_order(actors: Sequence[Any]) -> tuple[list[Any], list[Location]]:
    """The actors (`Placed`) as ranks: node by node in the order their placement groups were made (the order
    in which the nodes first appear), by GPU index inside a node; with their locations."""
    where = locations(actors)
    first_seen: dict[str, int] = {}
    for loc in where:
        first_seen.setdefault(loc.node_id, len(first_seen))
    order = sorted(range(len(actors)), key=lambda i: (first_seen[where[i].node_id], where[i].gpus, i))
    return [actors[i] for i in order], [where[i] for i in order]


def locations(actors: Sequence[Any]) -> list[Location]:
    """Where each of these `Placed` actors runs."""
    import ray

    return ray.get([a.location.remote() for a in actors])


def placement_map(trainers: Sequence[Any], engines: Sequence[Any]) -> dict[str, list[Location]]:
    """Where every trainer rank (in rank order) and every engine runs: node id and IP, node-local GPU indices."""
    return {"trainer": locations(trainers), "engines": locations(engines)}


def describe(locations: Sequence[Location]) -> str:
    """One line: the actors (by index) and GPUs on each node, e.g. `10.0.0.1 [0-7] GPUs 0-7; ...`."""
    by_node: dict[str, list[int]] = {}
    for i, loc in enumerate(locations):
        by_node.setdefault(loc.node_id, []).append(i)
    parts = []
    for members in by_node.values():
        loc = locations[members[0]]
        gpus = sorted(g for i in members for g in locations[i].gpus)
        parts.append(f"{loc.node_ip} [{_span(members)}]" + (f" GPUs {_span(gpus)}" if gpus else ""))
    return "; ".join(parts)


def _span(values: list[int]) -> str:
    consecutive = values == list(range(values[0], values[0] + len(values)))
    return f"{values[0]}-{values[-1]}" if consecutive and len(values) > 1 else ",".join(map(str, values))


def _gpus_per_node() -> list[int]:
    import ray

    return [int(node["Resources"].get("GPU", 0)) for node in ray.nodes() if node["Alive"]]


def _reserve(bundle_lists: list[list[dict[str, float]]], what: str, timeout_s: float) -> list[Any]:
    """STRICT_PACK placement groups, one per bundle list, placed within `timeout_s` (or removed, and an error)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    groups = [placement_group(bundles, strategy="STRICT_PACK") for bundles in bundle_lists]
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        for group in groups:
            remove_placement_group(group)
        free, total = ray.available_resources().get("GPU", 0), ray.cluster_resources().get("GPU", 0)
        raise TimeoutError(
            f"{what}: {len(groups) - len(ready)} of {len(groups)} placement group(s) not placed within "
            f"{timeout_s:.0f} s (each {len(bundle_lists[0])} x {bundle_lists[0][0]} on one node); the cluster has "
            f"{free:g} of {total:g} GPUs "
            "free: another job or actor holds them, or the nodes lack CPUs"
        )
    return groups


def _in_bundle(group: Any, index: int, gpus: int) -> dict[str, Any]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
    return {"num_cpus": 1, "num_gpus": gpus, "scheduling_strategy": strategy}
