"""The driver killed with SIGKILL three times at random points, then run to the end with the same command.

A real `megatron-rl train` of the CPU recipe (SGLang, megatron-core, Ray, reward workers) in a session of
its own. Each launch is killed a random 0-1.5 s after it wrote a new checkpoint, so the kills land in
generation, a train step, a checkpoint save or a weight push. After every kill: no process of the run is
left (Ray's head and agents, the engine, the reward workers), and `latest` names a complete checkpoint.
At the end: every step logged exactly once, and the sampler lost and repeated nothing: the prompts drawn
from the data equal the groups trained on plus those in flight at the last checkpoint (prompts in flight at
a kill are drawn again first on resume).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from small_run import small_run

from megatron_rl.config import load_config
from megatron_rl.data.datasets import load_splits

pytestmark = [pytest.mark.slow, pytest.mark.run]

TOTAL_STEPS, EVERY, KILLS = 16, 2, 3
ARGS = small_run(
    f"total_steps={TOTAL_STEPS}",
    f"checkpoint.every_steps={EVERY}",
    "checkpoint.keep_last=2",
    "eval.every_steps=4",
    "logging.wandb=disabled",
    "logging.live_scaling_fit=false",
)


def _run_processes(marker: str) -> list[str]:
    """Live (not zombie) processes whose environment carries `marker`: everything the run started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() not in (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            found.append(f"{entry.name}: {command[:120]}")
    return found


def _latest(checkpoints: Path) -> str | None:
    marker = checkpoints / "latest"
    return marker.read_text().strip() if marker.exists() else None


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_sigkilled_driver_leaves_nothing_behind_and_resumes_exactly(tmp_path):
    marker = f"driver-kill-{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="disabled", MEGATRON_RL_TEST_MARKER=marker)
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "scalerl-cpu"]
    command += [f"output_dir={tmp_path}", "name=killed", *ARGS]
    run_dir, rng = tmp_path / "killed", random.Random(1234)
    checkpoints = run_dir / "checkpoints"
    logs = []

    for kill in range(KILLS + 1):
        log = (tmp_path / f"launch{kill}.log").open("w")
        logs.append(log.name)
        driver = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if kill == KILLS:
            assert driver.wait(timeout=900) == 0, Path(log.name).read_text()[-5000:]
            break
        before = _latest(checkpoints)
        _wait(lambda b=before, d=driver: _latest(checkpoints) != b or d.poll() is not None, 600, "a new checkpoint")
        assert driver.poll() is None, Path(log.name).read_text()[-5000:]
        time.sleep(rng.uniform(0.0, 1.5))
        os.kill(driver.pid, signal.SIGKILL)  # the driver only, as the OOM killer would
        driver.wait()
        try:
            _wait(lambda: not _run_processes(marker), 60, "the run's processes to end")
        except AssertionError:
            raise AssertionError(f"left behind after kill {kill}: {_run_processes(marker)}") from None
        latest = checkpoints / _latest(checkpoints)
        assert (latest / "run_state.pt").exists() and (latest / "megatron_rl.json").exists(), latest

    # The driver's own helpers (multiprocessing's resource tracker) end on its exit, a moment after it.
    try:
        _wait(lambda: not _run_processes(marker), 60, "the run's processes to end")
    except AssertionError:
        raise AssertionError(f"left behind after the clean end: {_run_processes(marker)}") from None
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines[1:]]
    assert "run" in json.loads(lines[0])
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == list(range(1, TOTAL_STEPS + 1)), steps  # each step once, in order
    assert sum("resumed from" in Path(name).read_text() for name in logs) == KILLS

    state = torch.load(checkpoints / _latest(checkpoints) / "run_state.pt", weights_only=False)["run"]
    assert state["step"] == TOTAL_STEPS
    sampler = state["sampler"]
    train = load_splits(load_config("scalerl-cpu", None, ARGS).data).train
    drawn = sum(sampler["epoch"][s] * len(train[s]) + sampler["position"][s] for s in train)
    consumed = sum(r.get("train/sampled_groups", 0) for r in rows)
    assert drawn - sampler["retired_skips"] == consumed + len(sampler["outstanding"]), (
        drawn,
        sampler["retired_skips"],
        consumed,
        len(sampler["outstanding"]),
    )


def test_sigterm_checkpoints_at_the_end_of_the_step_and_exits_cleanly(tmp_path):
    """SIGTERM (`kill`, `scancel` without a signal, a container stop) reaches the run even though `ray.init`
    installs Ray's own handler in the driver: the run checkpoints the step it is in, says so and exits 0."""
    marker = f"driver-term-{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="disabled", MEGATRON_RL_TEST_MARKER=marker)
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "scalerl-cpu"]
    command += [f"output_dir={tmp_path}", "name=term", *ARGS, "total_steps=400", "checkpoint.every_steps=1000"]
    metrics = tmp_path / "term" / "metrics.jsonl"
    log = (tmp_path / "term.log").open("w")
    driver = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def trained() -> list[int]:
        lines = metrics.read_text().splitlines()[1:] if metrics.exists() else []
        return [json.loads(line)["step"] for line in lines if '"train/loss"' in line]

    _wait(lambda: len(trained()) >= 2 or driver.poll() is not None, 600, "two training steps")
    assert driver.poll() is None, Path(log.name).read_text()[-5000:]
    os.kill(driver.pid, signal.SIGTERM)
    assert driver.wait(timeout=300) == 0, Path(log.name).read_text()[-5000:]
    text = Path(log.name).read_text()
    assert "stopped by SIGTERM" in text, text[-5000:]
    last = max(trained())
    assert _latest(tmp_path / "term" / "checkpoints") == f"step_{last:08d}"
    _wait(lambda: not _run_processes(marker), 30, "the run's processes to end")
