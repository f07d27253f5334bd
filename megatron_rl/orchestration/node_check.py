"""The check every GPU node passes before Ray starts on it: its NVIDIA driver runs the image's CUDA, its GPUs
are as many and as large as the run was planned for, and Transformer Engine imports where the run uses it.

    megatron-rl node-check --recipe R --model M [--gpus 8] [overrides]      (slurm/bootstrap.sh, once per node)

One line per node: `node-check: <host>: ...: ok`, or exit 2 with the reason and the numbers. Without it, a host
driver older than the image's CUDA fails on every node deep inside the first CUDA call (`apptainer --nv` puts
the host's libcuda first), and a smaller GPU than `compute.device_memory_gib` fails at the first large
allocation, after the cluster is up and the checkpoint read.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass

from megatron_rl.config import ConfigError, RunConfig

IMAGE_CUDA = "13.0"
"""The CUDA of the GPU image (env/Dockerfile's base image; tests/unit/test_gpu_env.py keeps the two in step)."""
MIN_DRIVER = 580
"""The oldest NVIDIA driver branch that runs CUDA 13.0 (NVIDIA's CUDA compatibility table)."""


@dataclass(frozen=True)
class GPU:
    driver: str
    memory_gib: float


def query_gpus() -> list[GPU]:
    """This node's GPUs as nvidia-smi reports them; ConfigError when there is no NVIDIA driver to ask."""
    if shutil.which("nvidia-smi") is None:
        raise ConfigError("node-check: no NVIDIA driver on this node (nvidia-smi not found)")
    query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader,nounits"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(f"node-check: nvidia-smi failed: {reason[0] if reason else f'exit {done.returncode}'}")
    gpus = []
    for line in done.stdout.strip().splitlines():
        driver, memory_mib = (field.strip() for field in line.split(","))
        gpus.append(GPU(driver, float(memory_mib) / 1024))
    return gpus


def node_problems(run: RunConfig, gpus: list[GPU], expected: int | None) -> list[str]:
    """What keeps `run` from this node's GPUs, each naming the numbers (empty: the node is fit)."""
    problems = []
    if not gpus:
        return ["no GPU visible (nvidia-smi lists none)"]
    if expected is not None and len(gpus) < expected:
        problems.append(f"{len(gpus)} GPUs visible, the allocation gives {expected} per node")
    drivers = sorted({g.driver for g in gpus})
    major = int(drivers[0].split(".")[0])
    if major < MIN_DRIVER:
        problems.append(
            f"NVIDIA driver {drivers[0]} cannot run the image's CUDA {IMAGE_CUDA} (needs >= {MIN_DRIVER}; "
            "or install the CUDA forward-compatibility package)"
        )
    smallest = min(g.memory_gib for g in gpus)
    if smallest < run.compute.device_memory_gib:
        problems.append(
            f"GPUs of {smallest:.1f} GiB, the run is planned for {run.compute.device_memory_gib} GiB "
            "(compute.device_memory_gib; plan again with the node's size)"
        )
    return problems


def check_node(run: RunConfig, expected: int | None = None) -> str:
    """The one-line verdict for this node; ConfigError with the reasons when it is not fit."""
    host = socket.gethostname()
    gpus = query_gpus()
    problems = node_problems(run, gpus, expected)
    if run.trainer_uses_transformer_engine:  # a broken binding fails at model build as a bare TypeError otherwise
        from megatron_rl.trainer.model import transformer_engine_import_error

        broken = transformer_engine_import_error()
        if broken is not None:
            problems.append(f"Transformer Engine is installed but does not import ({broken})")
    if problems:
        raise ConfigError(f"node-check: {host}: " + "; ".join(problems))
    return (
        f"node-check: {host}: driver {gpus[0].driver} (CUDA {IMAGE_CUDA} needs >= {MIN_DRIVER}), "
        f"{len(gpus)} x {min(g.memory_gib for g in gpus):.1f} GiB: ok"
    )
