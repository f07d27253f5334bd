"""Checkpoint conversion throughput and peak memory: HF -> megatron_rl checkpoint -> HF, bit for bit.

    OMP_NUM_THREADS=1 python benchmarks/bench_convert.py --model llama3_8b --pp 2 --workdir /tmp/bench_convert
    python benchmarks/bench_convert.py --model tiny_moe --ep 2 model.num_layers=4     # quick

1. A random HF checkpoint of the model config is written shard by shard (bf16, 5 GB shards, one shard
   held at a time; names and shapes from the mapping itself). A checksum of every tensor is kept; this
   step is not timed as conversion.
2. Import: `megatron-rl convert --from-hf` with the given layout (its tp x pp x ep ranks are spawned), as
   the trainer holds it: bf16 body, fp32 output layer.
3. The HF weights are deleted (disk: one copy of the model at a time plus the checkpoint).
4. Export: `megatron-rl convert --to-hf --dtype bf16` (one process).
5. The exported tensors are checked against the checksums (names, shapes, dtypes and bytes).

Throughput = checkpoint bytes / wall time of the command (Python start and megatron import included).
Peak memory is sampled every 0.1 s over the command's process tree (spawned ranks and helpers summed) as
proportional set size (PSS), and its anonymous part (without the page cache of memory-mapped safetensors
files, which the kernel can drop at will).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from megatron_rl.config import ModelConfig, apply_overrides, build, load_model_dict

GB = 1e9


def model_config(name: str, overrides: list[str]) -> ModelConfig:
    data = apply_overrides({"model": load_model_dict(name)}, overrides)["model"]
    return build(ModelConfig, data, prefix="model")  # type: ignore[no-any-return]


def digest(tensor) -> str:  # type: ignore[no-untyped-def]
    import torch

    return hashlib.blake2b(tensor.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def write_random_hf(cfg: ModelConfig, out: Path, seed: int) -> dict[str, tuple[list[int], str, str]]:
    """A random bf16 HF checkpoint of `cfg`; returns name -> (shape, dtype, checksum)."""
    import torch
    from transformers import AutoConfig

    from megatron_rl.convert.hf_files import ShardedWriter
    from megatron_rl.models import canonical_shapes, family, hf_plan

    kwargs = family(cfg).hf_config(cfg)
    AutoConfig.for_model(kwargs.pop("model_type"), **kwargs, dtype="bfloat16").save_pretrained(out)
    plan = hf_plan(cfg, [(name, shape, torch.bfloat16) for name, shape in canonical_shapes(cfg).items()])
    writer = ShardedWriter(out, 5 * 10**9, plan)
    generator = torch.Generator().manual_seed(seed)
    sums = {}
    for name, shape, _ in plan:
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        writer.add(name, tensor)
        sums[name] = (list(shape), str(tensor.dtype), digest(tensor))
    writer.close()
    return sums


class PeakMemory:
    """Peak proportional set size of a process tree (bytes, summed over its processes), sampled in a thread.

    PSS splits pages shared between processes (the checkpoint writer's forked helpers, mapped files read
    by several ranks) among them, so the sum is the tree's real footprint. Reported twice: all of it, and
    its anonymous part (Pss_Anon: without the page cache of memory-mapped safetensors files).
    """

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.pss = self.anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pss = anon = 0
            try:
                for proc in [self.root, *self.root.children(recursive=True)]:
                    rollup = Path(f"/proc/{proc.pid}/smaps_rollup").read_text()
                    fields = {k.strip(): v for k, _, v in (line.partition(":") for line in rollup.splitlines()[1:])}
                    pss += int(fields["Pss"].split()[0]) * 1024
                    anon += int(fields["Pss_Anon"].split()[0]) * 1024
            except (psutil.Error, OSError, KeyError, ValueError):
                pass  # a process ended between listing and reading
            self.pss, self.anon = max(self.pss, pss), max(self.anon, anon)
            time.sleep(0.1)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.pss, self.anon


def run_cli(args: list[str]) -> tuple[float, int, int, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_rl.cli", "convert", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    memory = PeakMemory(proc.pid)
    out, err = proc.communicate()
    elapsed = time.perf_counter() - start
    pss, anon = memory.stop()
    if proc.returncode:
        sys.exit(f"convert {' '.join(args)} failed:\n{err[-4000:]}")
    phases = [line for line in (out + err).splitlines() if line.startswith(("import:", "export:"))]
    return elapsed, pss, anon, " | ".join(phases)


def verify(out: Path, sums: dict[str, tuple[list[int], str, str]]) -> bool:
    from megatron_rl.convert.hf_files import HFReader

    reader = HFReader(out)
    if reader.names != set(sums):
        print(f"names differ: {sorted(reader.names ^ set(sums))[:10]}")
        return False
    for name, (shape, dtype, checksum) in sums.items():
        tensor = reader.get(name)
        if list(tensor.shape) != shape or str(tensor.dtype) != dtype or digest(tensor) != checksum:
            print(f"{name} differs")
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama3_8b", help="model config (model_configs/)")
    parser.add_argument("overrides", nargs="*", metavar="model.field=value")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_convert"))
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints in --workdir")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    cfg = model_config(args.model, args.overrides)
    work = args.workdir / cfg.name
    shutil.rmtree(work, ignore_errors=True)
    hf, ckpt, exported = work / "hf", work / "megatron", work / "exported"
    start = time.perf_counter()
    sums = write_random_hf(cfg, hf, seed=0)
    nbytes = sum(_numel(shape) * 2 for shape, _, _ in sums.values())
    print(f"{cfg.name}: {nbytes / GB:.2f} GB bf16 HF checkpoint written in {time.perf_counter() - start:.0f} s")

    layout = ["--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep)]
    import_s, import_pss, import_anon, import_log = run_cli(["--from-hf", str(hf), "--out", str(ckpt), *layout])
    for weights in [*hf.glob("*.safetensors"), hf / "model.safetensors.index.json"]:
        weights.unlink(missing_ok=True)
    export_s, export_pss, export_anon, export_log = run_cli(
        ["--to-hf", str(ckpt), "--out", str(exported), "--dtype", "bf16"]
    )
    identical = verify(exported, sums)
    results: dict[str, Any] = {
        "model": cfg.name,
        "gigabytes": nbytes / GB,
        "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep},
        "import": {"seconds": import_s, "GB/s": nbytes / GB / import_s, "peak_pss_GB": import_pss / GB,
                   "peak_anon_GB": import_anon / GB, "log": import_log},
        "export": {"seconds": export_s, "GB/s": nbytes / GB / export_s, "peak_pss_GB": export_pss / GB,
                   "peak_anon_GB": export_anon / GB, "log": export_log},
        "bit_identical": identical,
    }  # fmt: skip
    print("| direction | layout | GB | seconds | GB/s | peak PSS GB (all processes) | of which anonymous GB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for direction in ("import", "export"):
        r = results[direction]
        where = f"TP{args.tp} PP{args.pp} EP{args.ep}" if direction == "import" else "1 process"
        print(
            f"| {direction} | {where} | {nbytes / GB:.2f} | {r['seconds']:.1f} | {r['GB/s']:.3f} | "
            f"{r['peak_pss_GB']:.2f} | {r['peak_anon_GB']:.2f} |"
        )
    print(f"round trip bit-identical: {identical}")
    print(import_log)
    print(export_log)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    if not identical:
        sys.exit(1)


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


if __name__ == "__main__":
    main()
