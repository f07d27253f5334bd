"""SIGTERM while `megatron-rl train` starts (Ray, the starting policy, engines and trainer ranks coming up).

A real start of the CPU recipe in a session of its own, signalled at two points of its start-up: while Ray's local
head starts, and once the engines are launching. Nothing can be checkpointed yet, so the start is abandoned: one
line says so and names the signal, the exit status is 128 + 15, and no process of the run is left (Ray's head and
agents, the engine, the reward workers).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.run]

ARGS = ["total_steps=2", "data.val_prompts=8", "eval.downstream.benchmarks=[]", "logging.wandb=disabled"]


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


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.parametrize("moment", ["ray-starting", "engines-starting"])
def test_sigterm_during_start_up_ends_the_start_in_one_line(tmp_path, moment):
    marker = f"start-term-{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="disabled", MEGATRON_RL_TEST_MARKER=marker)
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "scalerl-cpu"]
    command += [f"output_dir={tmp_path}", "name=start", *ARGS]
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with out.open("w") as stdout, err.open("w") as stderr:
        driver = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    # The data is read while Ray's head starts; the engines' logs open once the starting policy is ready (after a
    # first run's warm-up, which is start-up too).
    started = (lambda: "data:" in out.read_text()) if moment == "ray-starting" else None
    if started is None:
        started = lambda: (tmp_path / "start" / "logs" / "engine0.log").exists()  # noqa: E731
    try:
        _wait(lambda: started() or driver.poll() is not None, 300, moment)
        assert driver.poll() is None, err.read_text()[-3000:]
        os.kill(driver.pid, signal.SIGTERM)
        code = driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    errors = err.read_text()
    stopped = [line for line in errors.splitlines() if line.startswith("megatron-rl: stopped by SIGTERM")]
    assert code == 128 + signal.SIGTERM, (code, errors[-3000:])
    assert stopped == [
        "megatron-rl: stopped by SIGTERM during start-up, before the first step: nothing was trained or saved by this "
        "start (no checkpoint was written yet); run the same command to start again"
    ], errors[-3000:]
    assert "Traceback" not in errors and "SIGTERM received" not in errors, errors[-3000:]
    assert "still running after its shutdown" not in out.read_text()  # Ray's own shutdown ended its processes
    try:
        _wait(lambda: not _run_processes(marker), 30, "the run's processes to end")
    except AssertionError:
        raise AssertionError(f"left behind: {_run_processes(marker)}") from None
    assert not (tmp_path / "start" / "metrics.jsonl").exists()
