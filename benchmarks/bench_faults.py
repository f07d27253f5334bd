"""Recovery times of the faults a long run meets, on the real stack (SGLang, megatron-core, Ray).

    OMP_NUM_THREADS=1 python benchmarks/bench_faults.py [--repeats 2] [--sync-timeout 10] [--json out.json]

- hung engine during a weight push: a SGLang engine stopped (SIGSTOP) between two buckets of an update.
  Measured: stop -> SyncError naming the engine (bounded by `rollout.sync_timeout_s`), the kill and
  teardown of the broken group, the restart until the engine answers, and a fresh group's first update.
- killed engine: SIGKILL -> restarted and ready (what a generation request waits for before its retry,
  plus one weight push).
- SIGKILLed driver: a `megatron-rl train` run of the CPU recipe killed right after its first checkpoint.
  Measured: kill -> no process of the run left (the watcher's sweep), and the same command started again
  -> the first new step logged (start-up: Ray, the engine, the trainer, the checkpoint load).

Prints one table; times are wall seconds on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from megatron_rl.config import EngineConfig, ModelConfig, build, load_config, load_model_dict
from megatron_rl.generator.server import SGLangServer, free_port
from megatron_rl.generator.weight_sync import SyncError, WeightSender, make_buckets
from megatron_rl.models.tiny import build_tiny_model


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {name: t + 0.01 for name, t in sorted(load_file(str(model_dir / "model.safetensors")).items())}


def engine_faults(work: Path, sync_timeout: float) -> dict[str, float]:
    model_dir = build_tiny_model(work / "model", build(ModelConfig, load_model_dict("cpu_demo")), seed=3)
    new = _weights(model_dir)
    engine = EngineConfig(device="cpu", dtype="float32", tp=1, fp32_lm_head=True)
    rollout = load_config("scalerl-cpu", None, [f"rollout.sync_timeout_s={sync_timeout}"]).rollout
    server = SGLangServer(model_dir, engine, work / "engine.log", max_total_tokens=4096)
    server.start()
    asyncio.run(server.wait_ready(timeout_s=600))
    times: dict[str, float] = {}
    sender = WeightSender([server.url], "127.0.0.1", free_port(), rollout)
    try:
        sender.connect()
        sender.send(make_buckets(new.items(), 1 << 20), version=1)

        def stopped():
            for i, bucket in enumerate(make_buckets(new.items(), 1 << 20)):
                if i == 1:
                    os.killpg(server.pid, signal.SIGSTOP)
                yield bucket

        start = time.perf_counter()
        try:
            sender.send(stopped(), version=2)
            raise AssertionError("the push to a stopped engine did not fail")
        except SyncError as exc:
            assert exc.engines == [0], exc.engines
        times["hung: stop -> SyncError"] = time.perf_counter() - start
        start = time.perf_counter()
        os.killpg(server.pid, signal.SIGKILL)
        server.process.wait()
        sender.close()
        times["hung: kill + group teardown"] = time.perf_counter() - start
        start = time.perf_counter()
        asyncio.run(server.restart(timeout_s=600))
        times["engine restart -> ready"] = time.perf_counter() - start
        start = time.perf_counter()
        sender = WeightSender([server.url], "127.0.0.1", free_port(), rollout)
        sender.connect()
        sender.send(make_buckets(new.items(), 1 << 20), version=3)
        times["new group + catch-up push"] = time.perf_counter() - start

        start = time.perf_counter()
        os.killpg(server.pid, signal.SIGKILL)
        server.process.wait()
        sender.close()
        asyncio.run(server.restart(timeout_s=600))
        sender = WeightSender([server.url], "127.0.0.1", free_port(), rollout)
        sender.connect()
        sender.send(make_buckets(new.items(), 1 << 20), version=4)
        times["killed: restart + resync + push"] = time.perf_counter() - start
    finally:
        sender.close()
        server.stop()
    return times


def _tagged(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
            except OSError:
                pass
    return found


def driver_kill(work: Path) -> dict[str, float]:
    marker = f"bench-faults-{uuid.uuid4().hex}"
    env = dict(os.environ, PYTHONWARNINGS="ignore", MEGATRON_RL_TEST_MARKER=marker)
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "scalerl-cpu", f"output_dir={work}"]
    command += ["name=killed", "total_steps=6", "checkpoint.every_steps=2", "logging.wandb=disabled"]
    command += ["data.val_prompts=16", "eval.every_steps=100", "rollout.prompts_per_step=8"]
    command += ["rollout.generations_per_prompt=4", "logging.live_scaling_fit=false"]
    latest = work / "killed" / "checkpoints" / "latest"
    metrics = work / "killed" / "metrics.jsonl"
    log = (work / "driver.log").open("w")
    driver = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while not latest.exists():
        if driver.poll() is not None:
            raise RuntimeError(f"the run ended before its first checkpoint; see {log.name}")
        time.sleep(0.05)
    resumed_from = int(latest.read_text().strip().removeprefix("step_"))
    processes = len(_tagged(marker))
    start = time.perf_counter()
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    while _tagged(marker):
        time.sleep(0.05)
    times = {"driver: processes of the run": float(processes), "driver: kill -> nothing left": 0.0}
    times["driver: kill -> nothing left"] = time.perf_counter() - start
    start = time.perf_counter()
    driver = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def new_step() -> bool:
        if not metrics.exists():
            return False
        rows = [json.loads(line) for line in metrics.read_text().splitlines()[1:] if line.strip()]
        return any("train/loss" in r and r["step"] > resumed_from for r in rows)

    while not new_step():
        if driver.poll() is not None:
            raise RuntimeError(f"the resumed run ended early; see {log.name}")
        time.sleep(0.1)
    times["driver: relaunch -> first new step"] = time.perf_counter() - start
    driver.wait(timeout=600)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sync-timeout", type=float, default=10.0, help="rollout.sync_timeout_s for the hung engine")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    samples: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench_faults_") as tmp:
            for fault in (engine_faults(Path(tmp), args.sync_timeout), driver_kill(Path(tmp))):
                for name, seconds in fault.items():
                    samples.setdefault(name, []).append(seconds)
    print(f"\nsync_timeout_s = {args.sync_timeout:g}; {args.repeats} repeats; {os.cpu_count()} CPUs\n")
    print("| measurement | median | min | max |")
    print("|---|---:|---:|---:|")
    for name, values in samples.items():
        unit = "" if name.endswith("processes of the run") else " s"
        cells = [f"{statistics.median(values):.1f}{unit}", f"{min(values):.1f}{unit}", f"{max(values):.1f}{unit}"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(samples, indent=2))


if __name__ == "__main__":
    main()
