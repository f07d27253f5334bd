"""The engine command line as SGLang itself reads it, and the engines' request table in the memory plan.

SGLang sizes a request-to-token table of (request slots + 1) x context-length int32s at start. Without
--context-length it takes the checkpoint's max_position_embeddings (10,485,760 for Llama-4 Scout's released
config): at least 2,048 slots x 10.5M x 4 B = 86 GB, an out-of-memory at engine start.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.generator.server import (
    SOCKET_PATH_MAX,
    SGLangServer,
    inductor_cache_dir,
    make_scratch,
    scratch_prefix,
)
from megatron_rl.plan import GIB, EngineMemory, make_plan

GPU_MODELS = ["llama3_8b", "qwen3_8b", "qwen3_4b", "qwen3_30b_a3b", "llama4_scout_17bx16e"]


def _sglang_args(command: list[str]):
    from sglang.srt.server_args import ServerArgs

    assert command[1:3] == ["-m", "sglang.launch_server"]
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(command[3:]))


@pytest.mark.parametrize("model_name", GPU_MODELS)
def test_every_gpu_engine_command_parses_in_sglang_with_the_rollouts_context_length(model_name, tmp_path):
    run = load_config("scalerl", model_name)
    engine = run.rollout.engine
    server = SGLangServer(tmp_path / "ckpt", engine, tmp_path / "engine.log", context_length=run.rollout.context_length)
    args = _sglang_args(server.command())
    r = run.rollout
    assert args.context_length == r.max_prompt_tokens + r.max_completion_tokens + 64 == r.context_length
    assert r.context_length <= run.model.max_position_embeddings
    assert (args.tp_size, args.dtype, args.mem_fraction_static) == (engine.tp, engine.dtype, engine.mem_fraction)
    assert args.enable_fp32_lm_head is engine.fp32_lm_head and args.weight_version == "0"


def test_the_request_table_follows_sglangs_rule_and_an_unbounded_context_is_refused():
    # 40 GiB of KV at 128 KiB per token (327,680 tokens): 512 slots per context's worth, clamped to [2048, 4096],
    # at most half the pool's tokens.
    short = EngineMemory(weights=0.0, kv_per_token=2**17, pool=40 * GIB, longest=1, in_flight=1, context=16_448)
    assert short.requests == 4096 and short.request_table == 4 * 4097 * 16_448
    scout_default = EngineMemory(0.0, 2**17, 40 * GIB, 1, 1, context=10_485_760)
    assert scout_default.requests == 2048 and scout_default.request_table / 1e9 > 85
    tiny_pool = EngineMemory(0.0, 2**17, GIB / 4, 1, 1, context=16_448)
    assert tiny_pool.requests == 1024  # half of the pool's 2,048 tokens

    run = load_config("scalerl", "llama3_8b")
    plan = make_plan(run, suggest=False)
    assert plan.fits and plan.engine.request_table < GIB
    # A static pool of 95% leaves 4 GiB outside it, less than the engine's reserve: no room for the table.
    refused = make_plan(load_config("scalerl", "llama3_8b", ["rollout.engine.mem_fraction=0.95"]), suggest=False)
    assert any("SGLang's request table" in p and "rollout.context_length" in p for p in refused.problems)


def test_the_engine_ready_deadline_is_sized_from_the_checkpoint_or_set(tmp_path):
    from megatron_rl.config import ConfigError, EngineConfig
    from megatron_rl.generator.server import ready_timeout_s

    for i in range(2):  # 2 x 109 GB, sparse: Scout's 218 GB of bf16 weights as far as st_size tells
        with (tmp_path / f"model-0000{i}.safetensors").open("wb") as f:
            f.truncate(109 * 10**9)
    assert ready_timeout_s(EngineConfig(), tmp_path) == pytest.approx(600 + 6 * 218)
    assert ready_timeout_s(EngineConfig(ready_timeout_s=120), tmp_path) == 120
    server = SGLangServer(tmp_path, EngineConfig(), tmp_path / "log")
    assert server.ready_timeout_s == pytest.approx(1908)
    with pytest.raises(ConfigError, match="rollout.engine.ready_timeout_s: must be > 0"):
        load_config("scalerl", "llama3_8b", ["rollout.engine.ready_timeout_s=0"])


def test_trainer_collectives_wait_longer_than_a_weight_push_can_take():
    """While rank 0 pushes a bucket to a hung engine (up to rollout.sync_timeout_s, then a second push after the
    restart) the other trainer ranks wait in a collective: their groups' timeout must outlast it, or NCCL's
    watchdog ends them first. Read back from the groups of a real one-rank trainer process group."""
    import subprocess
    import sys

    script = """
import torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron_rl.config import load_config
from megatron_rl.trainer.distributed import init_distributed
run = load_config("scalerl-cpu", None, ["rollout.sync_timeout_s=900"])
init_distributed(run.parallel, 0, timeout_s=run.collective_timeout_s)
groups = (dist.group.WORLD, ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group())
print([g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert ast.literal_eval(done.stdout.strip().splitlines()[-1]) == [4200.0] * 3  # 2 x 2 x 900 s + 10 min
    assert load_config("scalerl", "llama3_8b").collective_timeout_s == 1800.0  # megatron-core's 30 min floor


def test_the_weight_push_transient_is_planned_from_the_models_tensors():
    """Llama-3.1-8B pushed to bf16 engines: the largest tensor is the embedding (128,256 x 4,096 x 2 B, the fp32
    head going out in bf16 is the same size); rank 0 holds a bucket and its flat copy, each up to a bucket plus
    that tensor. A bucket too large for the step's free memory is refused naming the field."""
    from megatron_rl.plan import push_memory

    run = load_config("scalerl", "llama3_8b")
    push = push_memory(run)
    largest = 128_256 * 4_096 * 2
    assert push.largest == largest and push.largest_name == "embedding.word_embeddings.weight"
    assert push.rank0 == 2 * ((512 << 20) + largest) and push.other == 2 * largest
    plan = make_plan(run, suggest=False)
    assert plan.ranks[0].push == push.rank0 < plan.ranks[0].activations  # the step's activations dominate
    huge = make_plan(load_config("scalerl", "llama3_8b", ["rollout.sync_bucket_mb=30000"]), suggest=False)
    assert any("weight push" in p and "rollout.sync_bucket_mb=30000" in p for p in huge.problems), huge.problems


def test_a_context_beyond_the_checkpoints_positions_is_refused_before_the_engines_start(tmp_path):
    """SGLang refuses --context-length beyond the checkpoint's max_position_embeddings (nested under text_config in
    Scout's multimodal config.json): check and train say so first, naming the rollout budgets."""
    import json

    from megatron_rl.config import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 8192}}))
    run = load_config("scalerl", "llama4_scout_17bx16e", [f"model.hf_path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout.context_length: .*\(16448 tokens\) exceed the 8192 positions"):
        run.check_starting_model()
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 131072}))
    run.check_starting_model()
    cpu = load_config("scalerl-cpu")
    assert cpu.rollout.context_length <= cpu.model.max_position_embeddings  # the CPU run's model holds its rows


def test_sglang_loads_the_plugin_that_keeps_one_unloaded_weights_warning_per_process():
    """Through SGLang's own plugin loader, as its scheduler process does: Llama-4's per-bucket warning about the
    weights a bucket does not carry passes once (the checkpoint load), and other warnings pass untouched."""
    import subprocess
    import sys

    script = """
import logging, sys
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(name)s: %(message)s")
from sglang.srt.plugins import load_plugins
load_plugins()
log = logging.getLogger("sglang.srt.models.mllama4")
for bucket in range(3):
    log.warning(f"Some weights are not initialized from checkpoints {{'layers.{bucket}.w'}}")
log.warning("a different warning")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("sglang.srt.models.mllama4")]
    assert lines == [
        "sglang.srt.models.mllama4: Some weights are not initialized from checkpoints {'layers.0.w'}",
        "sglang.srt.models.mllama4: a different warning",
    ]


def test_a_cpu_engine_sleeps_when_idle(tmp_path):
    """A CPU engine's scheduler waits on its sockets when idle: polling took a core the trainer needed."""
    run = load_config("scalerl-cpu")
    server = SGLangServer(tmp_path / "ckpt", run.rollout.engine, tmp_path / "engine.log", context_length=176)
    args = _sglang_args(server.command())
    assert args.sleep_on_idle and args.device == "cpu" and args.attention_backend == "torch_native"


def test_a_cpu_engine_takes_one_torch_thread_unless_told(tmp_path, monkeypatch):
    """A CPU engine started from the driver (a one-machine run) gets what a Ray actor with one CPU gets: one torch
    thread, not one per core, which made its threads and the trainer's compete for the cores."""
    run = load_config("scalerl-cpu")
    server = SGLangServer(tmp_path / "ckpt", run.rollout.engine, tmp_path / "engine.log")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert server.env()["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert server.env()["OMP_NUM_THREADS"] == "3"


def test_a_cpu_engine_stops_without_crash_diagnostics_unless_asked(tmp_path, monkeypatch):
    """stop()'s SIGTERM ends the scheduler, which SGLang's server reads as a crash: its diagnostics sleep 5 s for
    a GPU to settle before dumping it. A CPU engine runs without them (a user's setting still wins); a GPU
    engine keeps SGLang's defaults."""
    for name in ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH"):
        monkeypatch.delenv(name, raising=False)
    run = load_config("scalerl-cpu")
    cpu = SGLangServer(tmp_path / "ckpt", run.rollout.engine, tmp_path / "engine.log")
    assert cpu.env()["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == cpu.env()["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    monkeypatch.setenv("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "1")
    assert cpu.env()["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
    gpu = SGLangServer(tmp_path / "ckpt", dataclasses.replace(run.rollout.engine, device="cuda"), tmp_path / "g.log")
    assert "SGLANG_CUDA_COREDUMP_BEFORE_CRASH" not in gpu.env()


def test_a_started_engine_keeps_its_temp_files_in_its_own_scratch(tmp_path, monkeypatch):
    """A started server's processes take its scratch directory as their temp directory (SGLang's socket files go
    there, and stop() removes it), while torch.compile's cache stays where it was, to outlive the server."""
    run = load_config("scalerl-cpu")
    server = SGLangServer(tmp_path / "ckpt", run.rollout.engine, tmp_path / "engine.log")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert server.env()["TMPDIR"] == str(tmp_path)  # not started: nothing of its own
    server.scratch = tmp_path / "scratch"
    env = server.env()
    assert env["TMPDIR"] == str(tmp_path / "scratch")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == inductor_cache_dir()
    assert scratch_prefix("0123456789abcdef") == "megatron_rl-01234567-"  # what a dead driver's reaper removes
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # a short temp path: room for SGLang's socket paths
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        made = make_scratch("0123456789abcdef")
        assert made is not None and made.parent == short and made.name.startswith("megatron_rl-01234567-")
        # Where SGLang's socket paths in a scratch would pass the 107 bytes of a UNIX socket path, there is none.
        deep = short / ("d" * 60)
        deep.mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(deep))
        assert len(str(deep)) + len("/megatron_rl-01234567-12345678/tmp12345678") > SOCKET_PATH_MAX
        assert make_scratch("0123456789abcdef") is None
    finally:
        shutil.rmtree(short)


def test_engine_and_store_ports_come_from_below_the_ephemeral_range(monkeypatch):
    """A port found by binding port 0 comes from the range every other process's bind(0) and outgoing connection
    draws from: released, it was taken by a trainer's rendezvous store before the engine bound it, and by another
    process before a trainer rank's store bound it (EADDRINUSE). Ports handed out, for engines and for trainer
    ranks' stores alike, lie below that range, are free when handed out, and are never handed out twice by one
    process; with no room below the range (every port ephemeral) the kernel picks."""
    from megatron_rl import ports
    from megatron_rl.trainer import distributed

    low = ports.ephemeral_range()[0]
    handed = [ports.free_port() for _ in range(40)] + [ports.free_port(""), distributed.free_port()]
    assert len(set(handed)) == len(handed)
    assert all(ports.PORT_FLOOR <= port < low for port in handed)
    for port in handed[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: binds without SO_REUSEADDR
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    try:  # a port held by a listener is never handed out
        monkeypatch.setattr(ports, "PORT_FLOOR", held.getsockname()[1])
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.PORT_FLOOR + 1, 60999))
        assert ports.free_port() != held.getsockname()[1]  # the kernel's pick, as if the range had no room
    finally:
        held.close()
