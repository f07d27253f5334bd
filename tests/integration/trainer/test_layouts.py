"""Parallel layouts at their full world size: megatron-core forms every shipped layout's groups, and the config
validation accepts exactly the layouts megatron-core accepts.

megatron runs in a fresh process (layout_worker.py) acting as each rank of a W-rank job under torch's fake
process-group backend: the groups are megatron's own, formed by `initialize_model_parallel`.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.config import MODEL_CONFIGS_DIR, ConfigError, load_config

WORKER = Path(__file__).with_name("layout_worker.py")
GPUS_PER_NODE = 8
SHIPPED = sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.yaml"))


def _form(tmp: Path, jobs: list[dict]) -> list[dict]:
    out = tmp / "layouts.pt"
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(jobs), str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_every_shipped_layout_forms_megatrons_groups_at_full_size(tmp_path):
    runs = {name: load_config("scalerl", name) for name in SHIPPED}
    jobs = []
    for run in runs.values():
        p = run.parallel
        etp = p.expert_tp(run.model.is_moe)
        world = p.trainer_devices
        jobs.append(dict(tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, etp=etp, world=world, ranks=list(range(world))))
    for (name, run), formed in zip(runs.items(), _form(tmp_path, jobs), strict=True):
        assert "error" not in formed, f"{name}: {formed.get('error')}"
        p, moe = run.parallel, run.model.is_moe
        expected = {"tp": p.tp, "pp": p.pp, "cp": p.cp, "dp": p.dp, "ep": p.ep, "etp": p.expert_tp(moe)}
        expected["edp"] = p.expert_dp(moe)
        for rank, groups in formed["ranks"].items():
            assert {k: len(v) for k, v in groups.items()} == expected, f"{name} rank {rank}"
            for kind in ("tp", "ep", "etp"):  # within one node of 8 GPUs when it can be (ranks fill nodes in order)
                if expected[kind] <= GPUS_PER_NODE:
                    assert len({r // GPUS_PER_NODE for r in groups[kind]}) == 1, f"{name} rank {rank}: {kind} {groups}"
            assert groups["tp"] == list(range(rank - rank % p.tp, rank - rank % p.tp + p.tp))


def _moe_layout(tp: int, pp: int, ep: int, etp: int, world: int, cp: int = 1) -> list[str]:
    model = ["model.num_layers=4", "model.num_attention_heads=8", "model.num_query_groups=4", "model.kv_channels=8"]
    model += ["model.ffn_hidden_size=128", "model.moe.num_experts=8", "model.moe.ffn_hidden_size=64"]
    parallel = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.ep={ep}", f"parallel.etp={etp}"]
    parallel += [f"parallel.cp={cp}"]
    parallel += [f"parallel.trainer_devices={world}", f"parallel.sequence_parallel={str(tp > 1).lower()}"]
    return model + parallel


def test_config_validation_accepts_exactly_the_layouts_megatron_forms(tmp_path):
    """A model whose dimensions every size divides, so that only the layout rules decide."""
    grid = list(itertools.product([1, 2, 4], [1, 2], [1, 2, 4, 8], [1, 2, 4], [4, 6, 8, 12, 16], [1, 2, 3]))
    ours = {}
    for tp, pp, ep, etp, world, cp in grid:
        try:
            load_config("scalerl-cpu", "tiny_moe", _moe_layout(tp, pp, ep, etp, world, cp))
            ours[(tp, pp, ep, etp, world, cp)] = None
        except ConfigError as exc:
            ours[(tp, pp, ep, etp, world, cp)] = str(exc)
    jobs = [
        dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, world=world, ranks=[0, world - 1])
        for tp, pp, ep, etp, world, cp in grid
    ]
    disagree = []
    for key, formed in zip(grid, _form(tmp_path, jobs), strict=True):
        if (ours[key] is None) != ("error" not in formed):
            disagree.append((key, ours[key], formed.get("error")))
    assert not disagree, disagree[:5]
    assert sum(v is None for v in ours.values()) > 20 and sum(v is not None for v in ours.values()) > 20


@pytest.mark.parametrize(
    "overrides, field, numbers",
    [
        (["parallel.etp=8"], "parallel.etp", "64 is not a multiple of etp x ep x pp = 8 x 16 x 1 = 128"),
        (["parallel.tp=3"], "parallel.trainer_devices", "64 must be a multiple of tp x pp = 3 x 1"),
        (["parallel.tp=16", "parallel.trainer_devices=32"], "parallel.tp", "query groups (8), got 16"),
        (["parallel.ep=3"], "parallel.ep", "num_experts=16, got 3"),
        (["parallel.trainer_devices=24"], "parallel.etp", "24 is not a multiple of etp x ep x pp = 1 x 16 x 1 = 16"),
        (["parallel.sequence_parallel=false"], "parallel.sequence_parallel", "MoE with tp > 1"),
        (["parallel.cp=3"], "parallel.trainer_devices", "64 must be a multiple of tp x cp x pp = 4 x 3 x 1"),
    ],
)
def test_a_layout_megatron_cannot_form_is_refused_naming_field_and_numbers(overrides, field, numbers):
    with pytest.raises(ConfigError, match=field) as error:
        load_config("scalerl", "llama4_scout_17bx16e", overrides)
    assert numbers in str(error.value)
