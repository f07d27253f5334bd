"""SGLang generator engines: managed server processes and an async client on SGLang's native HTTP API.

    server = SGLangServer(model_dir, engine_cfg, log_path); server.start(); await server.wait_ready()
    client = SGLangClient(server.url)
    segment = await client.generate(input_ids, max_new_tokens, stop_ids, sampling)   # -> interruption.Segment
    balancer = EngineBalancer([client, ...], sampling, max_retries)                 # a GenerateFn

Per-token policy versions come from SGLang itself: every `/generate` answer carries `weight_versions`,
spans of output tokens with the weight version that produced them (we set the version to the trainer's
step on each update), so a sequence that lived through in-flight weight updates reports exactly which
tokens came from which policy (PipelineRL). Generator log-probs are SGLang's fp32 per-token log-probs.

A dead or unreachable engine raises `EngineError`; the balancer retries the request on another engine
(counted) up to `max_retries` times. On CPU the server runs SGLang's torch-native path
(`SGLANG_USE_CPU_ENGINE=1`, `--device cpu --attention-backend torch_native`), installed by
tools/install_sglang.sh.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from megatron_rl.config import EngineConfig, SamplingConfig
from megatron_rl.rollout.interruption import Segment


class EngineError(RuntimeError):
    """An engine could not answer (dead process, refused connection, HTTP error)."""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class SGLangServer:
    """One `sglang.launch_server` process group, its port and its log."""

    def __init__(
        self,
        model_path: Path,
        cfg: EngineConfig,
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_total_tokens: int | None = None,
    ) -> None:
        self.model_path, self.cfg, self.log_path = Path(model_path), cfg, Path(log_path)
        self.host, self.port = host, port or _free_port()
        self.max_total_tokens = max_total_tokens
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_path)]
        cmd += ["--host", self.host, "--port", str(self.port), "--tp-size", str(self.cfg.tp)]
        cmd += ["--dtype", self.cfg.dtype, "--mem-fraction-static", str(self.cfg.mem_fraction)]
        cmd += ["--weight-version", "0", "--skip-server-warmup"]
        if self.cfg.device == "cpu":
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
        if self.max_total_tokens:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.cfg.fp32_lm_head:
            cmd += ["--enable-fp32-lm-head"]
        return cmd + list(self.cfg.extra_args)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if self.cfg.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise EngineError(f"SGLang server on port {self.port} exited while starting:\n{self.log_tail()}")
                try:
                    async with session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(1.0)
        self.stop()
        raise EngineError(f"SGLang server on port {self.port} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    async def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()
        await self.wait_ready()


def _version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0  # the server's initial "default" version


@dataclass
class SGLangClient:
    """Async client for one engine's native API."""

    url: str
    timeout_s: float = 600.0
    tp: int = 1
    session: aiohttp.ClientSession | None = None
    outstanding: int = 0

    async def _session(self) -> aiohttp.ClientSession:
        if self.session is None or self.session.closed:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self.session

    async def post(self, path: str, payload: dict[str, Any] | None = None) -> Any:
        session = await self._session()
        try:
            async with session.post(f"{self.url}{path}", json=payload or {}) as response:
                body = await response.json(content_type=None) if response.content_length != 0 else None
                if response.status != 200:
                    raise EngineError(f"{self.url}{path}: HTTP {response.status}: {body}")
                return body
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise EngineError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc

    async def get(self, path: str) -> Any:
        session = await self._session()
        try:
            async with session.get(f"{self.url}{path}") as response:
                if response.status != 200:
                    raise EngineError(f"{self.url}{path}: HTTP {response.status}")
                return await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise EngineError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc

    async def generate(
        self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int], sampling: SamplingConfig
    ) -> Segment:
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "stop_token_ids": stop_ids,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        self.outstanding += 1
        try:
            out = await self.post(
                "/generate", {"input_ids": input_ids, "sampling_params": params, "return_logprob": True}
            )
        finally:
            self.outstanding -= 1
        meta = out["meta_info"]
        tokens = [int(t) for _, t, _ in meta["output_token_logprobs"]]
        logprobs = [float(lp) for lp, _, _ in meta["output_token_logprobs"]]
        versions = [0] * len(tokens)
        spans = meta.get("weight_versions") or [{"version": meta.get("weight_version"), "start": 0, "end": len(tokens)}]
        for span in spans:
            for i in range(span["start"], min(span["end"], len(tokens))):
                versions[i] = _version(span["version"])
        finish = (meta.get("finish_reason") or {}).get("type", "abort")
        return Segment(tokens, logprobs, versions, finish if finish in ("stop", "length") else "abort")

    async def health(self) -> bool:
        try:
            session = await self._session()
            async with session.get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, ConnectionError):
            return False

    async def weight_version(self) -> int:
        return _version((await self.get("/model_info"))["weight_version"])

    async def pause(self, mode: str = "in_place") -> None:
        await self.post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self.post("/continue_generation", {})

    async def abort_all(self) -> None:
        await self.post("/abort_request", {"abort_all": True})

    async def flush_cache(self) -> None:
        await self.post("/flush_cache")

    async def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return await self.post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        out = await self.post(
            "/update_weights_from_disk",
            {"model_path": model_path, "weight_version": str(version), "flush_cache": False},
        )
        if not out.get("success", False):
            raise EngineError(f"{self.url}: update_weights_from_disk failed: {out.get('message')}")

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


class EngineBalancer:
    """A GenerateFn over several engines: least outstanding requests first, failed requests retried.

    A request whose engine fails (EngineError) is retried on another engine, or on the same one after
    `on_failure` restarted it, up to `max_retries` times; each retry is counted in `retries`.
    """

    def __init__(self, clients: list[SGLangClient], sampling: SamplingConfig, max_retries: int = 3) -> None:
        if not clients:
            raise ValueError("EngineBalancer needs at least one engine")
        self.clients, self.sampling, self.max_retries = clients, sampling, max_retries
        self.retries = 0
        self.failures = 0
        self.on_failure: Any = None
        """Optional `async (client) -> None` hook, e.g. restart the engine's server."""

    def _pick(self, exclude: set[int]) -> SGLangClient:
        candidates = [c for i, c in enumerate(self.clients) if i not in exclude] or self.clients
        return min(candidates, key=lambda c: c.outstanding)

    async def __call__(self, input_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> Segment:
        failed: set[int] = set()
        for attempt in range(self.max_retries + 1):
            client = self._pick(failed)
            try:
                return await client.generate(input_ids, max_new_tokens, stop_ids, self.sampling)
            except EngineError:
                self.failures += 1
                failed.add(self.clients.index(client))
                if attempt == self.max_retries:
                    raise
                self.retries += 1
                if self.on_failure is not None:
                    await self.on_failure(client)
        raise AssertionError("unreachable")
