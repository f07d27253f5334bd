"""Trainer -> engines weight transfer, in flight (SCALERL.md §4, DESIGN.md "weight sync").

    sender = WeightSender(engine_urls, master_addr, master_port, rollout_cfg, engine_tp=1)
    sender.connect()                                   # once: a process group with every engine
    stats = sender.send(buckets, version=step)         # buckets of (HF name, full tensor)

`distributed` (default): trainer rank 0 and every engine rank form one process group (NCCL on GPUs,
gloo on CPU; the trainer is rank 0, engine i's ranks follow). For each bucket the trainer tells each
engine the names, dtypes and shapes over HTTP (`/update_weights_from_distributed`) and broadcasts the
tensors in that order; engines keep generating between buckets and running sequences keep their KV
cache (PipelineRL's in-flight update). `/begin_weight_update` and `/end_weight_update` bracket the
transfer (SGLang >= 0.5.23), and the last bucket sets the new weight version, which SGLang stamps on
every token generated after it. `disk`: the weights are written as safetensors and loaded with
`/update_weights_from_disk` (the fallback when no process group can be formed).

The process group helper follows the technique SGLang, verl and slime use for the same purpose (a
rendezvous store with a group-name prefix and torch's `_new_process_group_helper`), written here so
the trainer does not import SGLang.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config import RolloutConfig

GROUP_NAME = "megatron_rl_weight_sync"


class SyncError(RuntimeError):
    pass


def _post(url: str, payload: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            body = response.read()
    except Exception as exc:  # urllib raises several types; all mean the engine did not take the update
        raise SyncError(f"{url}: {type(exc).__name__}: {exc}") from exc
    return json.loads(body) if body else {}


def _check(url: str, out: dict[str, Any]) -> None:
    if out.get("success") is False:
        raise SyncError(f"{url}: {out.get('message')}")


def new_process_group(backend: str, addr: str, port: int, world_size: int, rank: int, group_name: str) -> Any:
    """A process group outside the default one (the trainer's own group stays untouched)."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(minutes=10)
    store, rank, world_size = next(rendezvous(f"tcp://{addr}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class WeightSender:
    def __init__(
        self, engine_urls: list[str], master_addr: str, master_port: int, cfg: RolloutConfig, engine_tp: int = 1
    ) -> None:
        self.urls, self.addr, self.port, self.cfg, self.engine_tp = (
            engine_urls,
            master_addr,
            master_port,
            cfg,
            engine_tp,
        )
        self.group: Any = None
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, len(engine_urls)))

    def _all(self, path: str, payloads: list[dict[str, Any]] | dict[str, Any]) -> list[concurrent.futures.Future]:
        if isinstance(payloads, dict):
            payloads = [payloads] * len(self.urls)
        return [self.pool.submit(_post, f"{url}{path}", p) for url, p in zip(self.urls, payloads, strict=True)]

    def connect(self) -> None:
        if self.cfg.weight_sync != "distributed":
            return
        world = 1 + self.engine_tp * len(self.urls)
        payloads = [
            {
                "master_address": self.addr,
                "master_port": self.port,
                "rank_offset": 1 + i * self.engine_tp,
                "world_size": world,
                "group_name": GROUP_NAME,
                "backend": self.backend,
            }
            for i in range(len(self.urls))
        ]
        futures = self._all("/init_weights_update_group", payloads)  # engines join while we create ours
        self.group = new_process_group(self.backend, self.addr, self.port, world, 0, GROUP_NAME)
        for url, future in zip(self.urls, futures, strict=True):
            _check(url, future.result())

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """Send every bucket, then set the engines' weight version; returns sync/* metrics."""
        started = time.perf_counter()
        total_bytes = 0
        if self.cfg.weight_sync == "disk":
            total_bytes = self._send_disk(buckets, version)
        else:
            for url, f in zip(self.urls, self._all("/begin_weight_update", {}), strict=True):
                _check(url, f.result())
            pending: list[tuple[str, torch.Tensor]] | None = None
            for bucket in buckets:
                if pending is not None:
                    total_bytes += self._broadcast(pending, version=None)
                pending = bucket
            if pending is not None:
                total_bytes += self._broadcast(pending, version=version)
            for url, f in zip(self.urls, self._all("/end_weight_update", {}), strict=True):
                _check(url, f.result())
        seconds = time.perf_counter() - started
        return {"sync/seconds": seconds, "sync/bytes": float(total_bytes), "sync/gb_per_s": total_bytes / 1e9 / seconds}

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]], version: int | None) -> int:
        payload: dict[str, Any] = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": GROUP_NAME,
            "flush_cache": False,  # running sequences keep their KV cache (in-flight update)
        }
        if version is not None:
            payload["weight_version"] = str(version)
        futures = self._all("/update_weights_from_distributed", payload)
        size = 0
        for _, tensor in bucket:
            tensor = tensor.contiguous()
            dist.broadcast(tensor, src=0, group=self.group)
            size += tensor.numel() * tensor.element_size()
        for url, f in zip(self.urls, futures, strict=True):
            _check(url, f.result())
        return size

    def _send_disk(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> int:
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="megatron_rl_sync_") as tmp:
            tensors = {name: t.contiguous() for bucket in buckets for name, t in bucket}
            save_file(tensors, str(Path(tmp) / "model.safetensors"))
            payload = {"model_path": tmp, "weight_version": str(version), "flush_cache": False, "load_format": "auto"}
            for url, f in zip(self.urls, self._all("/update_weights_from_disk", payload), strict=True):
                _check(url, f.result())
            return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        if self.group is not None:
            for future in self._all("/destroy_weights_update_group", {"group_name": GROUP_NAME}):
                with contextlib.suppress(SyncError):  # an engine that is already gone
                    future.result()
            dist.destroy_process_group(self.group)
            self.group = None
        self.pool.shutdown(wait=False)
