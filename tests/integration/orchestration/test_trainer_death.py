"""A trainer rank whose actor dies mid-run: the run stops at once with a message naming the rank and the
checkpoint to resume from, leaves that checkpoint complete, and the same command resumes from it.

The CPU recipe's run in this process (real SGLang, megatron-core, Ray); only the moment is staged: the
trainer actor is killed (`ray.kill`, as a node loss or the OOM killer would end it) just before the train
step that would make version 3, after the checkpoint of step 2.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from small_run import small_run

from megatron_rl.config import load_config
from megatron_rl.metrics import read_metrics
from megatron_rl.orchestration.actors import TrainerGroup
from megatron_rl.trainer.checkpoint import latest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.run]

ARGS = small_run(
    "total_steps=3",
    "checkpoint.every_steps=2",
    "logging.wandb=disabled",
    "logging.live_scaling_fit=false",
    "checkpoint.save_on_signal=false",  # the run shares this process with pytest
)


@pytest.fixture
def local_ray():
    import ray

    yield
    ray.shutdown()


def test_a_dead_trainer_rank_stops_the_run_with_its_checkpoint_named(tmp_path, monkeypatch, local_ray):
    import ray

    from megatron_rl.orchestration.train import RunStopped, train

    run = load_config("scalerl-cpu", None, [f"output_dir={tmp_path}", "name=dead", *ARGS])
    call = TrainerGroup.call
    killed_at: list[float] = []

    async def killing_call(group: TrainerGroup, method: str, *args: Any) -> Any:
        if method == "train_step" and not killed_at and await call(group, "version") == 2:
            ray.kill(group.workers[0], no_restart=True)
            killed_at.append(time.monotonic())
        return await call(group, method, *args)

    monkeypatch.setattr(TrainerGroup, "call", killing_call)
    with pytest.raises(RunStopped) as stopped:
        train(run)
    stopped_after = time.monotonic() - killed_at[0]
    message = str(stopped.value)
    assert "trainer rank 0 died during train_step" in message
    assert "step_00000002" in message and "run the same command to resume" in message
    assert stopped_after < 120, stopped_after  # engines and workers stopped, nothing waited on the dead rank
    assert latest_checkpoint(tmp_path / "dead" / "checkpoints").name == "step_00000002"

    monkeypatch.setattr(TrainerGroup, "call", call)
    ray.shutdown()
    train(run)  # the same command resumes from step 2 and finishes
    steps = [r["step"] for r in read_metrics(tmp_path / "dead" / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3]
