"""Placement of trainer ranks and SGLang engines on a simulated multi-node GPU cluster.

Ray nodes started on this machine declare 8 GPUs each (`ray.cluster_utils.Cluster`); no GPU exists, but
Ray still reserves them, hands each actor its node-local GPU indices and sets CUDA_VISIBLE_DEVICES. The
cluster is the paper's run (docs/recipe.md §6: 80 GPUs, 16 training and 64 generating) as 10 nodes of 8 GPUs,
plus a head without GPUs like a driver node.

- Each shipped model config is placed whole with its own parallel layout (tp, ep, etp, engine tp) at that
  split: 16 trainer ranks and 64 // engine.tp engines (Llama-3-8B ships exactly that).
- Scout ships 64 trainer GPUs and 8 TP-8 engines (16 nodes). 16 raylets were more than this 2-core machine
  could start next to other jobs (the GCS timed out), so that layout is placed at full size part by part on
  the 10 nodes: the trainer alone (8 nodes), then the engines alone (8 nodes).

The trainer is a real `TrainerGroup` whose ranks are `TrainerWorker`s with a `setup` that records the rank and
the rendezvous address it is given instead of starting megatron. Bare `Placed` actors stand in for engines
(the base class of `EngineHost`): they go through the same functions as `EngineGroup` (`engine_placement`,
`spawn`, `Placed.location`) and only say where they run. All simulated nodes share this machine's IP, so the
rendezvous is checked by the Ray node of the actor that handed out the address, not by the address.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from megatron_rl.config import RunConfig, load_config
from megatron_rl.orchestration import actors
from megatron_rl.orchestration.placement import (
    Location,
    Placed,
    check_cluster,
    engine_placement,
    locations,
    spawn,
    trainer_placement,
)

GPUS_PER_NODE = 8
NODES = 10
TRAINER_GPUS, GENERATOR_GPUS = 16, 64
LAYOUTS = ("llama4_scout_17bx16e", "llama3_8b")


def _paper_split(model: str) -> RunConfig:
    """The model's shipped config with 16 trainer ranks and 64 generator GPUs."""
    engine_tp = load_config("scalerl", model).rollout.engine.tp
    split = [f"parallel.trainer_devices={TRAINER_GPUS}", f"rollout.engine.num_engines={GENERATOR_GPUS // engine_tp}"]
    return load_config("scalerl", model, split)


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    # A loaded machine delays raylet heartbeats: do not declare a slow node dead after the default ~15 s.
    patience = {"health_check_failure_threshold": 60}
    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0, "_system_config": patience})
    try:
        for _ in range(NODES):
            sim.add_node(wait=False, num_cpus=GPUS_PER_NODE, num_gpus=GPUS_PER_NODE)
        sim.wait_for_nodes()
        ray.init(address=sim.address, include_dashboard=False, log_to_driver=False)
        yield NODES
    finally:
        ray.shutdown()
        sim.shutdown()


def _release(handles: list[Any], *placements: Any) -> None:
    import ray

    for actor in handles:
        ray.kill(actor)
    for placement in placements:
        placement.remove()


def _trainer_group(run: RunConfig, monkeypatch: pytest.MonkeyPatch) -> actors.TrainerGroup:
    """`TrainerGroup` as the driver builds it, its ranks recording what `setup` gives them (no megatron)."""

    class Rank(actors.TrainerWorker):
        def __init__(self) -> None:
            self.handed_out: list[tuple[str, int]] = []

        def rendezvous(self) -> tuple[str, int]:
            self.handed_out.append(super().rendezvous())
            return self.handed_out[-1]

        def setup(self, run: dict[str, Any], rank: int, world_size: int, master_addr: str, master_port: int) -> None:
            self.rank, self.joined = rank, (world_size, master_addr, master_port)

        def report(self) -> dict[str, Any]:
            import ray

            node = ray.get_runtime_context().get_node_id()
            return {"node": node, "rank": self.rank, "joined": self.joined, "handed_out": self.handed_out}

    monkeypatch.setattr(actors, "TrainerWorker", Rank)
    return actors.TrainerGroup(run, {})


def _check_rendezvous(group: actors.TrainerGroup) -> None:
    """The trainer's process group and the weight-sync group meet where rank 0 runs: the node of the first
    bundle of the trainer's first placement group (rank 0's bundle), at an address that node's actor handed out."""
    import asyncio

    import ray
    from ray.util.placement_group import placement_group_table

    sync = asyncio.run(group.rendezvous())
    reports = ray.get([w.report.remote() for w in group.workers])
    rank0_node = placement_group_table(group.placement.groups[0])["bundles_to_node_id"][0]
    assert [r["rank"] for r in reports] == list(range(len(group.workers)))
    assert reports[0]["node"] == group.locations[0].node_id == rank0_node
    world, addr, port = reports[0]["joined"]
    assert all(r["joined"] == (world, addr, port) for r in reports) and world == len(reports) and port > 0
    for address in ((addr, port), sync):
        givers = [(r["rank"], r["node"]) for r in reports if address in r["handed_out"]]
        assert givers == [(0, rank0_node)], (address, givers)


def _check_trainer(run: RunConfig, where: list[Location]) -> None:
    """Rank r on the trainer's node r // 8, local GPU r % 8; TP and node-sized expert groups inside a node."""
    p = run.parallel
    assert len(where) == p.trainer_devices
    trainer_nodes = list(dict.fromkeys(loc.node_id for loc in where))
    assert len(trainer_nodes) == math.ceil(p.trainer_devices / GPUS_PER_NODE)
    for rank, loc in enumerate(where):
        assert loc.node_id == trainer_nodes[rank // GPUS_PER_NODE], rank
        assert loc.gpus == (rank % GPUS_PER_NODE,), rank
    # Megatron's TP groups are consecutive ranks, its expert groups etp x ep consecutive ranks.
    expert_block = p.expert_tp(run.model.is_moe) * p.ep
    for size in [p.tp] + ([expert_block] if expert_block <= GPUS_PER_NODE else []):
        for start in range(0, p.trainer_devices, size):
            assert len({loc.node_id for loc in where[start : start + size]}) == 1, (size, start)


def _check_engines(run: RunConfig, where: list[Location]) -> None:
    """Each engine holds engine.tp distinct GPUs of one node (one actor, so one node)."""
    engine = run.rollout.engine
    assert len(where) == engine.num_engines
    for loc in where:
        assert len(set(loc.gpus)) == engine.tp and all(0 <= g < GPUS_PER_NODE for g in loc.gpus)


def _gpus(where: list[Location]) -> list[tuple[str, int]]:
    return [(loc.node_id, g) for loc in where for g in loc.gpus]


@pytest.mark.parametrize("model", LAYOUTS)
def test_layout_at_the_paper_split_is_placed_by_node(cluster, model, monkeypatch):
    run = _paper_split(model)
    assert run.compute.device_kind == "gpu" and run.rollout.engine.device == "cuda"
    trainer = _trainer_group(run, monkeypatch)
    engines = engine_placement(run)
    hosts = spawn(Placed, engines)
    try:
        where = trainer.locations
        engine_where = locations(hosts)
        _check_trainer(run, where)
        _check_engines(run, engine_where)
        used = _gpus(where + engine_where)  # no GPU handed out twice; the run fills the cluster
        assert len(used) == len(set(used)) == TRAINER_GPUS + GENERATOR_GPUS == cluster * GPUS_PER_NODE
        _check_rendezvous(trainer)
    finally:
        trainer.shutdown()
        _release(hosts, engines)


def test_scout_shipped_layout_part_by_part(cluster, monkeypatch):
    run = load_config("scalerl", "llama4_scout_17bx16e", ["rollout.engine.device=cpu"])  # the trainer alone
    trainer = _trainer_group(run, monkeypatch)
    try:
        _check_trainer(run, trainer.locations)
        assert len(set(_gpus(trainer.locations))) == run.parallel.trainer_devices
        _check_rendezvous(trainer)
    finally:
        trainer.shutdown()

    run = load_config("scalerl", "llama4_scout_17bx16e", ["compute.device_kind=cpu_core"])  # the engines alone
    engines = engine_placement(run)
    hosts = spawn(Placed, engines)
    try:
        engine_where = locations(hosts)
        _check_engines(run, engine_where)
        assert len(set(_gpus(engine_where))) == run.rollout.engine.num_engines * run.rollout.engine.tp
    finally:
        _release(hosts, engines)


def test_unplaceable_run_fails_fast_naming_what_is_missing(cluster):
    nodes = cluster
    too_many = (nodes + 1) * GPUS_PER_NODE
    run = load_config("scalerl", "llama3_8b", [f"parallel.trainer_devices={too_many}"])
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        trainer_placement(run)
    assert time.monotonic() - start < 5
    assert f"the trainer needs {too_many} GPUs in {nodes + 1} nodes of {GPUS_PER_NODE}" in str(err.value)
    assert f"the cluster has {nodes} node(s) with {GPUS_PER_NODE} GPUs" in str(err.value)

    # Trainer fits, engines do not: refused before the trainer reserves anything.
    engines = (nodes - 2) * GPUS_PER_NODE + 1
    run = load_config("scalerl", "llama3_8b", [f"rollout.engine.num_engines={engines}"])
    with pytest.raises(ValueError, match=rf"the engines need {engines} x 1 GPUs.*room for {engines - 1} engine"):
        trainer_placement(run)


def test_placement_held_by_others_times_out(cluster):
    """GPUs the check counts but another holder keeps: the run fails after the timeout, not never."""
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = cluster
    hog = placement_group([{"GPU": GPUS_PER_NODE}] * nodes, strategy="STRICT_SPREAD")
    hog.wait(30)
    try:
        run = load_config("scalerl", "llama3_8b", ["rollout.engine.num_engines=1"])
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="not placed within 2 s.*the cluster has 0 of"):
            trainer_placement(run, timeout_s=2)
        assert time.monotonic() - start < 10
    finally:
        remove_placement_group(hog)


def test_cluster_check_rules():
    """The check alone: GPU-less nodes ignored, unequal nodes refused, TP and engines kept inside a node."""
    run = load_config("scalerl", "llama3_8b", ["rollout.engine.num_engines=16"])  # 16 trainer + 16 engine GPUs
    assert check_cluster(run, [0, 8, 8, 8, 8]) == 8
    with pytest.raises(ValueError, match="GPU nodes differ"):
        check_cluster(run, [8, 8, 4, 8])
    with pytest.raises(ValueError, match="has none"):
        check_cluster(run, [0])
    with pytest.raises(ValueError, match="room for 8 engine"):
        check_cluster(run, [8, 8, 8])
    # 12 trainer GPUs: the second node keeps 4 for engines.
    run = load_config("scalerl", "llama3_8b", ["parallel.trainer_devices=12", "rollout.engine.num_engines=12"])
    assert check_cluster(run, [8, 8, 8]) == 8
    with pytest.raises(ValueError, match="parallel.tp=2 must divide the 3 GPUs of a node"):
        check_cluster(run, [3] * 10)
    run = load_config("scalerl", "llama3_8b", ["rollout.engine.tp=16", "rollout.engine.num_engines=1"])
    with pytest.raises(ValueError, match="rollout.engine.tp=16 must divide the 8 GPUs of a node"):
        check_cluster(run, [8, 8, 8])
