"""SGLang generator engines as managed server processes: command line, port, log, lifetime, restart.

    server = SGLangServer(model_dir, engine_cfg, run_dir / "logs/engine0.log"); server.start()
    await server.wait_ready()                    # /health answers, or EngineError with the log's tail
    server.url                                   # for generator/client.py

On CPU the server runs SGLang's torch-native path (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu
--attention-backend torch_native`), installed by tools/install_sglang.sh (docs/cpu.md §4).
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import aiohttp

from megatron_rl.config import EngineConfig
from megatron_rl.generator.client import EngineTimeoutError, EngineUnavailableError
from megatron_rl.ports import free_port, port_is_free

CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
"""KV-cache pool size on CPU when none is given: SGLang would otherwise size it from a fraction of host RAM,
which on a shared machine takes memory other processes need."""


SERVER_KEEPALIVE_S = 60
"""Idle keep-alive of the servers we start (SGLang's uvicorn default is 5 s)."""


READY_BASE_S = 600.0
READY_S_PER_GB = 6.0
"""(ours) The engine-ready deadline when `rollout.engine.ready_timeout_s` is null: a base for start-up and kernel
compilation, plus a read rate of ~170 MB/s for the checkpoint (a shared file system under a cold start)."""


def ready_timeout_s(cfg: EngineConfig, model_path: str | Path) -> float:
    """`cfg.ready_timeout_s`, or the deadline sized from the checkpoint's safetensors."""
    if cfg.ready_timeout_s is not None:
        return cfg.ready_timeout_s
    size = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    return READY_BASE_S + READY_S_PER_GB * size / 1e9


BIND_RETRIES = 3
"""(ours) Starts on a fresh port, per `wait_ready`, after a server could not bind the one it was given."""

RUN_TAG = "MEGATRON_RL_RUN_ID"
"""The run id a driver tags its processes with (orchestration/reaper.py): it names the servers' scratch."""


def scratch_prefix(run_id: str | None) -> str:
    """The name a server's scratch directory starts with, in the system temp directory: `megatron_rl-<first 8
    hex digits of the run id>-` for a server of a tagged run, so a dead driver's reaper finds and removes them
    (orchestration/reaper.py). Short: SGLang's socket paths are made under it and a UNIX socket path has at most
    107 bytes (a Slurm job's TMPDIR can be long)."""
    return f"megatron_rl-{run_id[:8]}-" if run_id else "megatron_rl-"


SOCKET_PATH_MAX = 107
"""Linux's limit on a UNIX socket path (`sun_path`, 108 bytes with its NUL): ZMQ's ipc endpoints are such paths."""


def make_scratch(run_id: str | None) -> Path | None:
    """A fresh scratch directory for one server start, or None where SGLang's socket paths in it (a temp file
    name, `tmp` + 8 characters) would be too long: the server then keeps the system temp directory."""
    prefix = scratch_prefix(run_id)
    longest = os.path.join(tempfile.gettempdir(), prefix + "x" * 8, "tmp" + "x" * 8)
    if len(os.fsencode(longest)) > SOCKET_PATH_MAX:
        return None
    return Path(tempfile.mkdtemp(prefix=prefix))


def inductor_cache_dir() -> str:
    """Where torch.compile keeps its cache by default (torch/_inductor/runtime/cache_dir_utils.py): in the temp
    directory, per user. A server's scratch directory is its temp directory; the compile cache stays here so
    that it outlives the server, as it did before."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


class SGLangServer:
    """One `python -m sglang.launch_server` process group: its command line, port, log, scratch and lifetime.

    The server runs in its own session (process group), so `stop()` ends the HTTP process, the scheduler
    and the detokenizer together, also when the HTTP process died first. Output goes to `log_path`
    (appended, one header line per start); errors quote its tail. Each start gets a scratch directory as the
    server's temp directory (TMPDIR), removed by `stop()`: SGLang names its ZMQ sockets after temp files it
    never deletes (five per start in 0.5.23), which otherwise pile up in /tmp, a few per run and hundreds per
    test session.
    """

    def __init__(
        self,
        model_path: str | Path,
        cfg: EngineConfig,
        log_path: str | Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_total_tokens: int | None = None,
        context_length: int | None = None,
    ) -> None:
        self.model_path, self.cfg, self.log_path = Path(model_path), cfg, Path(log_path)
        self.host = host
        self.port = port or free_port(host)
        if max_total_tokens is None and cfg.device == "cpu":
            max_total_tokens = CPU_DEFAULT_MAX_TOTAL_TOKENS
        self.max_total_tokens = max_total_tokens
        self.context_length = context_length
        self.ready_timeout_s = ready_timeout_s(cfg, self.model_path)
        """Tokens one request may reach (`rollout.context_length`); None: SGLang takes the checkpoint's
        max_position_embeddings, and sizes its request-to-token table from it (10M tokens for Scout: ~86 GB)."""
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.bind_retries = 0
        """Starts on a fresh port after the one given was taken before the server could bind it (`wait_ready`)."""
        self.scratch: Path | None = None
        """This start's temp directory (TMPDIR of the server's processes); None while stopped."""
        self.started_at = 0.0
        self.ready_seconds = 0.0
        """Seconds from the last start() to ready (set by wait_ready)."""
        self._log: IO[bytes] | None = None
        self._log_start = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_path)]
        cmd += ["--host", self.host, "--port", str(self.port), "--tp-size", str(self.cfg.tp)]
        cmd += ["--dtype", self.cfg.dtype, "--weight-version", "0", "--mem-fraction-static", str(self.cfg.mem_fraction)]
        # Token ids in, token ids and log-probs out (generator/client.py): the server never needs text, so its
        # detokenizer does no work (it decoded every generated token into text the run never read).
        cmd += ["--skip-tokenizer-init"]
        if self.max_total_tokens:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.context_length:
            cmd += ["--context-length", str(self.context_length)]
        if self.cfg.device == "cpu":
            # CPU: SGLang's torch-native attention (no kernels), no CUDA graphs, and no warm-up request
            # (a tiny model needs none; it costs seconds of start-up on 2 cores).
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
            cmd += ["--skip-server-warmup"]
            # An idle scheduler waits on its sockets instead of polling them: polling took a whole core while
            # the engine waited for the trainer (its start-up, every weight push), a core the trainer needed.
            cmd += ["--sleep-on-idle"]
        if self.cfg.fp32_lm_head:
            cmd += ["--enable-fp32-lm-head"]  # logits (hence sampling and log-probs) in fp32, docs/recipe.md §3
        return cmd + list(self.cfg.extra_args)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.scratch is not None:
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
            env["TMPDIR"] = str(self.scratch)
        env.setdefault("SGLANG_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEPALIVE_S))
        # `/health` answers from the server's status (503 while it starts or warms up, 200 once up) instead of
        # generating one token: SGLang's generating probe sleeps a whole second before it looks for the token, so
        # `wait_ready` saw every start ~1 s late, on the run's start-up path. Liveness is the process's
        # (orchestration/engines.py), not this probe's.
        env.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "0")
        if self.cfg.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's CPU platform defaults (no CUDA probing)
            # One torch thread, as a Ray actor with one CPU gets and as every trainer rank takes (OMP_NUM_THREADS
            # when set): at torch's default, one thread per core, the engine's threads and the trainer's competed
            # for the cores and the default run went from ~1.0 s to ~1.7 s a step on 2 cores.
            env.setdefault("OMP_NUM_THREADS", "1")
            # SGLang's crash diagnostics, a py-spy dump of the schedulers and a CUDA core dump after sleeping 5 s
            # "to let GPU activity settle", run whenever a scheduler exits unasked, as it does on `stop()`'s SIGTERM:
            # on CPU there is no GPU to settle and nothing to dump, with them every stop takes ~7 s instead of ~2.
            env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
            env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
        return env

    def start(self) -> None:
        if self.alive():
            raise RuntimeError(f"SGLang server on port {self.port} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self._log_start = self._log.tell()
        command = self.command()
        if self.scratch is not None:  # a start after the server died without a stop()
            shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch = make_scratch(os.environ.get(RUN_TAG))
        self._log.write(f"\n=== megatron_rl: {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n".encode())
        self._log.flush()
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,  # its own process group, so stop() reaches the scheduler processes too
        )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40, max_bytes: int = 65536) -> str:
        if not self.log_path.exists():
            return "(no log)"
        with self.log_path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    async def wait_ready(self, timeout_s: float | None = None, poll_s: float = 0.1) -> None:
        """Wait until `/health` answers 200; raise EngineError with the log tail if the server exits or
        is not ready in time (then it is stopped). A server that exits because another process took its port
        before it could bind it starts again on a fresh one (`self.url` changes), up to BIND_RETRIES times."""
        if self.process is None:
            raise RuntimeError("SGLangServer.start() first")
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        retries = 0
        probe = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=probe) as session:
            while True:
                if not self.alive():
                    code = self.process.returncode if self.process else None
                    self.stop()
                    if retries < BIND_RETRIES and self._lost_its_port():
                        retries += 1
                        self._start_on_fresh_port()
                        continue
                    message = f"SGLang server exited with code {code} while starting; log {self.log_path}:"
                    raise EngineUnavailableError(self.url, f"{message}\n{self.log_tail()}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{self.url}/health") as response:
                        if response.status == 200:
                            self.ready_seconds = time.monotonic() - self.started_at
                            return
                if time.monotonic() > deadline:
                    self.stop()
                    message = (
                        f"SGLang server not ready after {timeout_s:.0f} s (rollout.engine.ready_timeout_s); "
                        f"log {self.log_path}:"
                    )
                    raise EngineTimeoutError(self.url, f"{message}\n{self.log_tail()}")
                await asyncio.sleep(poll_s)

    def _lost_its_port(self) -> bool:
        """Whether this start's log says the HTTP listener could not bind its port (another process holds it)."""
        with self.log_path.open("rb") as f:
            f.seek(self._log_start)
            text = f.read().decode(errors="replace").lower()
        return "address already in use" in text

    def _start_on_fresh_port(self) -> None:
        taken, self.port = self.port, free_port(self.host)
        self.bind_retries += 1
        note = f"SGLang server could not bind port {taken} (another process holds it): starting on port {self.port}"
        print(f"engine: {note}", flush=True)
        with self.log_path.open("ab") as f:  # the log of the start that failed: its directory exists
            f.write(f"\n=== megatron_rl: {note}\n".encode())
        self.start()

    def stop(self, grace_s: float = 20.0) -> None:
        """End the whole process group: SIGTERM, then SIGKILL after `grace_s`; then remove its scratch."""
        if self.process is not None:
            pgid = self.process.pid  # the leader of its own session: its pid is the group id
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while self._group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if self._group_alive(pgid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                self.process.wait()
                deadline = time.monotonic() + 30.0  # SIGKILL is not refused; only unreaped zombies could stay
                while self._group_alive(pgid) and time.monotonic() < deadline:
                    time.sleep(0.1)
            self.process = None
        if self.scratch is not None:  # every process that used it has ended
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _group_alive(self, pgid: int) -> bool:
        if self.process is not None:
            self.process.poll()  # reap the leader, or it stays a zombie member of the group
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True

    async def restart(self, timeout_s: float | None = None, grace_s: float = 20.0) -> None:
        """Stop (SIGKILL after `grace_s`) and start again (on the same port if it is still free), then wait
        until ready. The stop waits in a thread: the caller's event loop (the driver's, for a local engine) goes on."""
        await asyncio.to_thread(self.stop, grace_s)
        if not port_is_free(self.host, self.port):
            self.port = free_port(self.host)
        self.restarts += 1
        self.start()
        await self.wait_ready(timeout_s)
