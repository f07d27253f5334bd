"""Trainer -> engines weight transfer, in flight (docs/recipe.md §4, docs/architecture.md).

    sender = WeightSender(engine_urls, master_addr, master_port, rollout_cfg)
    sender.connect()                                   # once: a process group with every engine
    stats = sender.send(buckets, version=step)         # buckets of (HF name, full tensor)
    sender.close()

One update, for both transports:
1. `/pause_generation` on every engine (mode `in_place` by default: running sequences stop between two
   forward passes and keep their KV cache; PipelineRL's in-flight update. `retract` sends them back to
   the queue instead, so every token after the update is computed from the new weights only, at the
   cost of recomputing the running sequences' KV).
2. `distributed` (default): `/begin_weight_update`, then per bucket `/update_weights_from_distributed`
   with the bucket's names, dtypes and shapes while the trainer, rank 0 of a process group that holds
   every engine rank (NCCL on GPUs, gloo on CPU), broadcasts the bucket as one flat byte tensor
   (SGLang's `flattened_bucket` format: one collective per bucket instead of one per tensor); the last
   bucket carries the new weight version; then `/end_weight_update` (SGLang >= 0.5.23 rejects updates
   outside that bracket). `disk`: the weights are written as safetensors to `disk_dir` (which every
   engine must see) and loaded with `/update_weights_from_disk`.
3. `/flush_cache` (drop prefix-cache KV of the old weights; SGLang refuses while sequences are running,
   so after an in-place pause it succeeds only on an idle engine), then `/continue_generation`. SGLang
   stamps every token generated after the update with the new version.

A failure while weights are being sent raises SyncError and leaves the engines paused with partly
updated weights (resuming would generate from a mix of two policies); the caller restarts them or sends
again (the engines that are still up have their update session closed, so a new `begin_weight_update`
is accepted). `SyncError.engines` names the engines to restart: those that failed a call, and those that
had not answered when the deadline passed.

Nothing waits longer than `timeout_s` (`rollout.sync_timeout_s`) on a dead or hung engine, whatever the
backend. A dead one fails the update within seconds (refused HTTP calls; gloo's "connection closed by
peer"). A hung one (stopped, wedged in a kernel) answers nothing: every HTTP call has its own deadline, and
the broadcast is issued asynchronously, from a thread of its own, and polled (`Work.is_completed`) against
the same deadline, also ending early when an engine refuses the bucket. Both matter on NCCL. There the
first collective of a group creates its communicator, and the issuing call itself blocks until every engine
has joined (a thread stuck there behind a hung engine is left behind, like gloo's below). And a collective
with a dead or hung peer never completes on its own: the group is created with a timeout of 2 x `timeout_s`, so our
deadline always passes first, and the broken communicator is then aborted (`_abort_process_group`, torch's
API for a communicator with an operation in flight; `destroy_process_group` would block on it) before
NCCL's watchdog reaches the group's timeout and, under the default TORCH_NCCL_ASYNC_ERROR_HANDLING, tears
down trainer rank 0. Gloo has no abort: its pending send ends with an error once the hung peer is
killed, so the caller kills the engines named in SyncError before `close()`, which then destroys the group
(and gives up on it, leaking nothing but a blocked thread, if that still has not happened within
`timeout_s`). Healthy engines on NCCL may be stuck in the same broadcast behind the hung one; they have
not answered by the deadline either, so they are named and restarted too. The engines' side of the group
uses torch's default timeout (30 min), which SGLang's HTTP API does not expose; it only matters when the
trainer dies mid-update, and then the engines are stopped with the run.

The process group outside torch's default group uses the same construction as SGLang's engine side
(`sglang.srt.utils.common.init_custom_process_group`) and slime's trainer side
(`slime/utils/distributed_utils.py::init_process_group`): a TCP rendezvous, a store prefixed with the group
name, and torch's `_new_process_group_helper`. The store layout has to match SGLang's for the ranks to
meet, which is why we build it the same way rather than constructing `ProcessGroupGloo` by hand.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Coroutine, Iterable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.config import RolloutConfig
from megatron_rl.generator.client import SGLangClient, SyncError

GROUP_NAME = "megatron_rl_weight_sync"
T = TypeVar("T")


def new_process_group(
    backend: str, addr: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float = 600.0
) -> Any:
    """A process group beside torch's default one (which the trainer keeps for itself, or lacks).

    Rank 0 hosts the rendezvous store at `addr:port`; the other ranks connect to it. Keys live under
    `group_name`, as in SGLang's `init_custom_process_group`, so an engine that joins with the same name
    meets this rank.
    """
    from torch.distributed.distributed_c10d import (
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{addr}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), prefixed, group_name=GroupName(group_name), timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group rank == rank in this group
    return group


def make_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list]:
    """Group (name, tensor) pairs in order into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """The bucket in sending order and its bytes back to back (SGLang's `flattened_bucket` layout).

    Wider dtypes go first so that every tensor starts at a multiple of its own element size, which the
    receiver checks before viewing the bytes as that dtype.
    """
    ordered = sorted(bucket, key=lambda item: -item[1].element_size())  # stable: keeps order within a dtype
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in ordered])
    return ordered, flat


def _issue_broadcast(flat: torch.Tensor, group: Any) -> Future[Any]:
    """`dist.broadcast(flat, src=0, async_op=True)` issued on a thread of its own; the future holds its Work.

    The issuing call itself can block: NCCL creates a group's communicator at its first collective, and
    SGLang's side of the group is created lazily too (`init_custom_process_group` without a device id), so
    the first broadcast waits in `ncclCommInitRank` until every engine has joined it, which a hung engine
    never does. Issued here, the caller's deadline holds through it. The thread is a daemon (a thread pool's
    would be joined at exit), and issues on the stream that produced `flat`, so ordering is the caller's.
    """
    future: Future[Any] = Future()
    stream = torch.cuda.current_stream(flat.device) if flat.is_cuda else None

    def issue() -> None:
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                future.set_result(dist.broadcast(flat, src=0, group=group, async_op=True))
        except BaseException as exc:  # handed to the caller, which marks the group broken
            future.set_exception(exc)

    threading.Thread(target=issue, name="weight-sync-broadcast", daemon=True).start()
    return future


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class WeightSender:
    """Trainer rank 0's side of weight sync to a set of SGLang engines (see the module docstring)."""

    def __init__(
        self,
        engine_urls: list[str],
        master_addr: str,
        master_port: int,
        cfg: RolloutConfig,
        engine_tp: int | None = None,
        *,
        pause_mode: Literal["in_place", "retract"] = "in_place",
        group_name: str = GROUP_NAME,
        disk_dir: str | Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if not engine_urls:
            raise ValueError("WeightSender needs at least one engine URL")
        self.urls, self.addr, self.port, self.cfg = list(engine_urls), master_addr, master_port, cfg
        self.engine_tp = engine_tp or cfg.engine.tp
        self.pause_mode, self.group_name = pause_mode, group_name
        self.timeout_s = cfg.sync_timeout_s if timeout_s is None else timeout_s
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.group: Any = None
        self.broken = False
        """A collective of the group failed or ran out of time: the group cannot be used again."""
        # The engine calls run on a private event loop in a thread: the HTTP request that makes an
        # engine receive a bucket must be in flight while this thread blocks in the broadcast.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()
        self.clients = [SGLangClient(url, timeout_s=self.timeout_s, tp=self.engine_tp) for url in self.urls]

    # --- helpers ------------------------------------------------------------------------------------

    def _submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _submit_each(self, call: str, *args: Any, **kwargs: Any) -> list[Future[Any]]:
        return [self._submit(getattr(c, call)(*args, **kwargs)) for c in self.clients]

    def _wait_each(self, futures: list[Future[T]], what: str, deadline: float | None = None) -> list[T]:
        """Results of one call per engine. Raises SyncError naming the engines that failed or had not
        answered by `deadline` (default: `timeout_s` from now); stops waiting at the first failure."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        concurrent.futures.wait(futures, max(0.0, deadline - time.monotonic()), concurrent.futures.FIRST_EXCEPTION)
        blamed, reasons = [], []
        for i, future in enumerate(futures):
            if future.done() and future.exception() is not None:
                blamed.append(i)
                reasons.append(str(future.exception()))
        if not blamed:
            for i, future in enumerate(futures):
                if not future.done():
                    blamed.append(i)
                    reasons.append(f"{self.urls[i]}: no answer within {self.timeout_s:.0f} s")
        if blamed:
            for future in futures:
                future.cancel()
            raise SyncError(f"{what}: " + "; ".join(reasons), blamed)
        return [future.result() for future in futures]

    def _all(self, call: str, *args: Any, **kwargs: Any) -> list[Any]:
        return self._wait_each(self._submit_each(call, *args, **kwargs), call)

    # --- API ----------------------------------------------------------------------------------------

    def connect(self) -> None:
        """Form the process group with every engine (distributed transport; nothing to do for disk)."""
        if self.cfg.weight_sync != "distributed":
            return
        if self.group is not None:
            raise RuntimeError("WeightSender.connect(): already connected; close() first")
        world = 1 + self.engine_tp * len(self.clients)
        deadline = time.monotonic() + self.timeout_s
        joined = [  # the engines wait in the rendezvous for rank 0, created next
            self._submit(
                c.init_weights_update_group(
                    self.addr, self.port, 1 + i * self.engine_tp, world, self.group_name, self.backend
                )
            )
            for i, c in enumerate(self.clients)
        ]
        try:
            # 2 x timeout_s: our own deadlines always pass first (see the module docstring)
            self.group = new_process_group(
                self.backend, self.addr, self.port, world, 0, self.group_name, 2 * self.timeout_s
            )
        except Exception as exc:  # torch raises RuntimeError/DistStoreError/...; say which group failed
            missing = [i for i, f in enumerate(joined) if not f.done() or f.exception() is not None]
            for future in joined:
                future.cancel()
            raise SyncError(f"weight-sync group {self.group_name} at {self.addr}:{self.port}: {exc}", missing) from exc
        self.broken = False
        self._wait_each(joined, "init_weights_update_group", deadline)

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> dict[str, float]:
        """Pause the engines, send every bucket, set `version`, resume; returns sync/* metrics."""
        if self.cfg.weight_sync == "distributed" and self.group is None:
            raise RuntimeError("WeightSender.send(): connect() first")
        if self.broken:
            raise SyncError("the weight-sync group is broken by an earlier failure: close() and connect() again")
        started = time.perf_counter()
        stream = (bucket for bucket in buckets if bucket)
        first = next(stream, None)  # made (e.g. gathered) before the engines pause
        if first is None:
            raise ValueError("WeightSender.send(): no weights to send")
        self._all("pause", self.pause_mode)
        paused = time.perf_counter()
        try:
            if self.cfg.weight_sync == "disk":
                total, count = self._send_disk([first, *stream], version), 1
            else:
                total, count = self._send_distributed(first, stream, version)
            # SGLang's prefix cache still holds KV computed with the old weights; a new request sharing a
            # cached prefix would reuse it. It can only be dropped while no request runs: always after a
            # retracting pause, and after an in-place pause when the engine happened to be idle (e.g.
            # between PPO-off-policy rounds). Otherwise stale prefixes age out like the KV of running
            # sequences (PipelineRL semantics); `sync/cache_flushed` says which happened.
            flushed = all(self._all("flush_cache"))
            if self.pause_mode == "retract" and not flushed:
                raise SyncError("flush_cache refused after a retracting pause (requests still running)")
        except Exception as exc:
            raise SyncError(
                f"weight update to version {version} failed; the engines stay paused with partly updated "
                f"weights: {exc}",
                getattr(exc, "engines", ()),
            ) from exc
        self._all("resume")
        seconds = time.perf_counter() - started
        return {
            "sync/seconds": seconds,
            "sync/paused_seconds": time.perf_counter() - paused,
            "sync/bytes": float(total),
            "sync/buckets": float(count),
            "sync/cache_flushed": float(flushed),
            "sync/gb_per_s": total / 1e9 / seconds,
        }

    def _send_distributed(
        self, first: list[tuple[str, torch.Tensor]], rest: Iterator[list[tuple[str, torch.Tensor]]], version: int
    ) -> tuple[int, int]:
        try:
            self._all("begin_weight_update")
            total, count = 0, 0
            pending = first
            for bucket in rest:  # one bucket of lookahead: the last one carries the new version
                total += self._broadcast(pending, version=None)
                count += 1
                pending = bucket
            total += self._broadcast(pending, version=version)
            self._all("end_weight_update")
        except Exception as exc:
            # SGLang refuses begin_weight_update while a session is open: close it on the engines that
            # are still up, so that a retry (after a dead engine was restarted) can open a new one. The
            # engines the error names (dead or hung) are skipped: waiting on a hung one again would double
            # the time the push takes to fail.
            self._try_all("end_weight_update", skip=getattr(exc, "engines", ()))
            raise
        return total, count + 1

    def _teardown_group(self) -> None:
        group = self.group
        if self.broken and self.backend == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group(group)
            return
        done = threading.Event()

        def destroy() -> None:
            dist.destroy_process_group(group)
            done.set()

        threading.Thread(target=destroy, name="weight-sync-destroy", daemon=True).start()
        if not done.wait(self.timeout_s):
            warnings.warn(
                f"weight-sync group {self.group_name}: not destroyed within {self.timeout_s:.0f} s (a peer is still "
                "hung in a collective); left behind",
                stacklevel=2,
            )

    def _try_all(self, call: str, skip: Iterable[int] = ()) -> None:
        """`call` on every engine but `skip`, best effort: errors (dead engine, no session open) are ignored."""
        skipped = set(skip)
        clients = [c for i, c in enumerate(self.clients) if i not in skipped]

        async def everyone() -> None:
            await asyncio.gather(*(getattr(c, call)() for c in clients), return_exceptions=True)

        with contextlib.suppress(TimeoutError):
            self._submit(everyone()).result(timeout=min(self.timeout_s, 60.0))

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]], version: int | None) -> int:
        ordered, flat = flatten_bucket(bucket)
        deadline = time.monotonic() + self.timeout_s
        received = self._submit_each(
            "update_weights_from_distributed",
            names=[name for name, _ in ordered],
            dtypes=[_dtype_name(t) for _, t in ordered],
            shapes=[list(t.shape) for _, t in ordered],
            group_name=self.group_name,
            version=version,
            flattened=True,
        )
        issued = _issue_broadcast(flat, self.group)
        while not (issued.done() and (issued.exception() is not None or issued.result().is_completed())):
            refused = any(f.done() and f.exception() is not None for f in received)
            if refused or time.monotonic() > deadline:
                # An engine refused the bucket (it will never join this collective) or did not take it in
                # time: the group is broken. Name the engines; `close()` tears the group down.
                self.broken = True
                self._wait_each(received, "update_weights_from_distributed", deadline)
                raise SyncError(
                    f"broadcast of a bucket: not complete within {self.timeout_s:.0f} s", range(len(self.clients))
                )
            time.sleep(0.002)
        try:
            issued.result().wait()  # raises the collective's own error (gloo: a peer closed the connection)
        except Exception:
            self.broken = True
            self._wait_each(received, "update_weights_from_distributed", deadline)
            raise
        self._wait_each(received, "update_weights_from_distributed", deadline)
        return flat.numel()

    def _send_disk(self, buckets: list[list[tuple[str, torch.Tensor]]], version: int) -> int:
        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().cpu() for bucket in buckets for name, t in bucket}
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=f"weights_v{version}_", dir=self.disk_dir))
        try:
            save_file(tensors, str(directory / "model.safetensors"))
            self._all("update_weights_from_disk", str(directory), version, flush_cache=False)  # flushed by send()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        """Leave the process group (engines first) and stop the HTTP thread. A broken group is aborted on NCCL;
        on gloo it is destroyed once its pending send has failed (the hung engine killed), and left behind,
        with a warning, if that takes longer than `timeout_s`."""
        if self.group is not None:
            destroyed = self._submit_each("destroy_weights_update_group", self.group_name)
            # a dead or restarted engine has no group left to destroy: errors and silence are both fine here
            concurrent.futures.wait(destroyed, min(self.timeout_s, 60.0))
            for future in destroyed:
                future.cancel()
            self._teardown_group()
            self.group = None
        if self._loop.is_running():

            async def close_clients() -> None:
                await asyncio.gather(*(c.close() for c in self.clients))

            self._submit(close_clients()).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()
