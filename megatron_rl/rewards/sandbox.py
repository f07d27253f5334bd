"""Run untrusted (model-written) Python programs in isolation, many at a time.

    sandbox = get_sandbox(cfg.sandbox)
    result = sandbox.run("print(int(input()) * 2)", stdin=b"21\n")   # RunResult(status='ok', stdout=b'42\n')

Every program runs in a fresh bubblewrap (`bwrap`, Debian package `bubblewrap`, installed by
tools/install_sandbox.sh) container, launched from a thread pool (`cfg.workers` at a time). Model code is
hostile input: the design assumes the program tries to escape, not that it fails by accident.

What is protected
- Network: a new, empty network namespace (loopback only): no connection leaves the sandbox, and host
  services on 127.0.0.1 or abstract Unix sockets are out of reach.
- Host files: the sandbox root is an empty tmpfs holding only read-only binds of /usr (and the Python
  prefix if it lives elsewhere), a fresh /proc of its own PID namespace, a minimal /dev, and the program's
  files in a read-only /sandbox. /etc, /root, /home, /work, the repository, the host's /proc are absent;
  the root is remounted read-only, so the only writable places are the private scratch /tmp (bounded
  tmpfs, cwd) and /dev/shm (small tmpfs), both gone when the program ends. Nothing is written on the host.
- Secrets: the environment is cleared (PATH, HOME, LANG only); the program never sees the expected outputs
  of its tests (rewards/code.py compares on the host).
- Other processes: a new PID namespace (host processes are invisible, so they cannot be signalled or
  ptraced), IPC and UTS namespaces, a new session (no terminal injection). When root, the sandbox runs as
  the unprivileged uid/gid 65534 (nobody) outside as well as inside its user namespace, with no
  capabilities and nested user namespaces disabled (`--disable-userns`: a common kernel attack surface).
- Resources, enforced inside the sandbox before the program's first line (setrlimit in the launcher):
  CPU time (RLIMIT_CPU), address space per process (RLIMIT_AS), processes and threads (RLIMIT_NPROC,
  counted per sandbox because each has its own user namespace), file size (RLIMIT_FSIZE), open files, no
  core dumps; wall time and total stdout+stderr size are enforced from the host, which then kills the
  whole sandbox (SIGKILL to its process group and to its PID-namespace init; when the init dies the kernel
  kills every process left in the namespace, daemons included).
- Total memory, when we are root and a memory+pids cgroup hierarchy (v2, or v1's) is writable: each
  sandbox gets its own cgroup capping all its processes, tmpfs pages and kernel buffers together at
  memory_mb + scratch + /dev/shm, and its process count. The process is held in a shell until it is in
  its cgroup, so bwrap and the program are born inside it.
- Lifetime: the program is PID 1 of its namespace (`--as-pid-1`), so a program that exits takes every
  process it started with it, and `--die-with-parent` ends the sandbox if the reward worker dies.

What is not protected
- The kernel: no seccomp filter, so a kernel exploit reachable by an unprivileged user in a user
  namespace is an escape. Use a VM (gVisor, Firecracker) when that matters.
- Side channels and host information under /proc (cpuinfo, meminfo, load, kernel version).
- Without a usable cgroup (not root, or a read-only or partial hierarchy) memory is limited per process
  (address space) only: the worst case is about max_processes * (memory_mb + OPEN_FILES *
  max_output_bytes of memfds and pipes) plus the scratch tmpfs. There is no I/O or CPU-share limit
  beyond CPU time in either case.
- Per-user kernel state shared by every sandbox's uid: keyrings (no seccomp filter to forbid keyctl).
- The harness process: a call-based solution runs in the same interpreter as its harness and can tamper with it
  (its report channel, globals, `json`, builtins). That decides no reward: the sandbox reports values only, as
  tagged plain data, and the host compares them with expected values that never enter the sandbox
  (rewards/code.py). Test programs (assert lists, HumanEval's `check`) run in a second sandbox of their own, the
  judge's, talking to the solution's only through the host (`Session`, rewards/judge.py), so nothing the solution
  does reaches the test or its verdict (tests/integration/rewards/test_reward_forgery.py).
- Development mode (`allow_unisolated`, loudly logged): only rlimits (no process limit), a scratch cwd, a
  scrubbed environment and a process group, as the calling user; the program can read and write the
  host, use the network, fork-bomb the user and leave daemons.

Ideas adopted: the launcher applying rlimits before running the code, and the docstring listing what is and
is not covered, from nanochat/OpenAI human-eval `execution.py` (which itself is "not a security
sandbox"); namespaces + read-only binds + tmpfs scratch via bubblewrap as in pybubble and rllm's firejail
executor; an unprivileged uid and a cgroup per box, as the ioi/isolate contest sandbox does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import psutil

from megatron_rl.config import SandboxConfig

log = logging.getLogger(__name__)

EXIT_COMPILE_ERROR = 113
"""Exit status of the launcher (and of rewards/code.py's harness) when the program does not compile."""
EXIT_MEMORY = 114
"""Exit status when the program raised MemoryError (it hit RLIMIT_AS)."""

SANDBOX_UID = 65534
"""nobody/nogroup: the uid the sandbox runs as outside its user namespace when we are root."""
SCRATCH_BYTES = 64 << 20
"""Size of the private, writable /tmp (tmpfs: its pages are memory)."""
SHM_BYTES = 8 << 20
OPEN_FILES = 64
"""RLIMIT_NOFILE; with RLIMIT_FSIZE it also bounds what memfds and pipes can hold per process."""
STDERR_TAIL_BYTES = 4096

USE_CGROUPS = True
"""Give each sandbox its own memory+pids cgroup when possible. Moving a process into a cgroup takes a
kernel-wide lock (~5-10 ms, benchmarks/README.md); False keeps the per-process rlimits only."""

STATUSES = ("ok", "compile_error", "timeout", "memory", "crash", "output_limit")

# The launcher runs inside the sandbox with the sandbox's Python (any 3.8+): it applies the limits, then
# compiles and runs the entry file. Compiling inside the sandbox matters: a hostile source can crash the
# compiler, and that crash must not happen in the reward worker. It imports nothing heavy (json and
# traceback would double the interpreter's start-up time): limits come as "NAME:soft:hard,...".
_LAUNCHER_BODY = r"""
import os, resource, sys

def main():
    limits, root, entry = sys.argv[1], sys.argv[2], sys.argv[3]
    for item in limits.split(","):
        name, soft, hard = item.split(":")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    path = os.path.join(root, entry)
    with open(path, "rb") as f:
        source = f.read()
    try:
        code = compile(source, path, "exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        sys.stderr.write("%s: %s\n" % (type(exc).__name__, exc))
        sys.stderr.flush()
        os._exit(COMPILE_ERROR)
    sys.argv = [path]
    sys.path.insert(0, root)
    try:
        exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
    except MemoryError:
        os._exit(MEMORY)

main()
"""
LAUNCHER = f"COMPILE_ERROR, MEMORY = {EXIT_COMPILE_ERROR}, {EXIT_MEMORY}\n" + _LAUNCHER_BODY


@dataclass
class RunResult:
    status: str
    """'ok' (exit 0), 'compile_error', 'timeout' (wall or CPU), 'memory', 'crash' or 'output_limit'."""
    exit_code: int | None
    """The program's exit status (a signal n reads 128+n), None if the host killed it."""
    stdout: bytes
    stderr: bytes
    """The last STDERR_TAIL_BYTES of stderr, for debugging."""
    cpu_s: float
    wall_s: float


class SandboxUnavailable(RuntimeError):
    """Isolation cannot be set up on this machine, and unisolated execution was not allowed."""


def sandbox_python() -> tuple[str, list[str]]:
    """The interpreter programs run with, and the bwrap binds it needs besides /usr."""
    for path in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(path):
            return path, ["--ro-bind", "/usr/local", "/usr/local"] if path.startswith("/usr/local") else []
    # No system Python: bind our own interpreter's prefix read-only at the same path. When it lives in a
    # directory the sandbox uid cannot traverse (/root/.pyenv), the probe fails and says so.
    prefix = os.path.realpath(sys.base_prefix)
    return os.path.join(prefix, "bin", "python3"), ["--ro-bind", prefix, prefix]


def _root_layout() -> list[str]:
    """/bin, /lib, ... as symlinks into /usr (merged-/usr systems) or read-only binds."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _limits(cfg: SandboxConfig, isolated: bool) -> str:
    """The launcher's rlimits, as "NAME:soft:hard,..."."""
    cpu = max(1, math.ceil(cfg.cpu_time_s))
    memory = cfg.memory_mb << 20
    limits = {
        # The soft limit sends SIGXCPU; the program is PID 1 of its namespace, which ignores it, so the
        # hard limit's SIGKILL one second later is what ends it (classified as 'timeout' from its CPU time).
        "RLIMIT_CPU": (cpu, cpu + 1),
        "RLIMIT_AS": (memory, memory),
        "RLIMIT_FSIZE": (cfg.max_output_bytes, cfg.max_output_bytes),
        "RLIMIT_NOFILE": (OPEN_FILES, OPEN_FILES),
        "RLIMIT_CORE": (0, 0),
    }
    if isolated:
        # Per user namespace, so per sandbox: the namespace's init (the program) counts as one.
        # Outside a user namespace RLIMIT_NPROC counts every process of the uid (and root is exempt).
        limits["RLIMIT_NPROC"] = (cfg.max_processes, cfg.max_processes)
    return ",".join(f"{name}:{soft}:{hard}" for name, (soft, hard) in limits.items())


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Sandbox:
    """Runs programs in bubblewrap with the limits of `cfg`; `submit` queues one on the thread pool."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.python, self.python_binds = sandbox_python()
        problem = isolation_problem(cfg)
        self.isolated = problem is None
        if problem is not None:
            if not cfg.allow_unisolated:
                raise SandboxUnavailable(
                    f"the code sandbox is unavailable: {problem}. Install bubblewrap "
                    "(`bash tools/install_sandbox.sh` as root, or `apt-get install bubblewrap`). For development "
                    "only, rewards.sandbox.allow_unisolated=true runs model code WITHOUT isolation."
                )
            self.python = sys.executable
            log.warning(
                "UNISOLATED CODE EXECUTION (rewards.sandbox.allow_unisolated=true): %s. Model-written programs "
                "run as this user with access to the host filesystem and network. Development only.",
                problem,
            )
        self._pool = concurrent.futures.ThreadPoolExecutor(cfg.workers, thread_name_prefix="sandbox")

    def submit(
        self, program: str, stdin: bytes = b"", files: Mapping[str, str | bytes] | None = None
    ) -> concurrent.futures.Future[RunResult]:
        return self._pool.submit(self.run, program, stdin, files)

    def map(self, jobs: Iterable[tuple[str, bytes]]) -> list[RunResult]:
        """Run (program, stdin) pairs concurrently on the pool; results in order."""
        futures = [self.submit(program, stdin) for program, stdin in jobs]
        return [future.result() for future in futures]

    def run(self, program: str, stdin: bytes = b"", files: Mapping[str, str | bytes] | None = None) -> RunResult:
        """Run `program` (Python source) with `stdin`; `files` are placed read-only next to it.

        Blocks the calling thread for at most about `wall_time_s`.
        """
        contents = self._contents(program, files)
        limits = _limits(self.cfg, self.isolated)
        if self.isolated:
            return _run_isolated(self.cfg, self.python, self.python_binds, contents, limits, stdin)
        return _run_unisolated(self.cfg, self.python, contents, limits, stdin)

    def start(self, program: str, files: Mapping[str, str | bytes] | None = None) -> Session:
        """Start `program` as a `Session` the caller talks to over its stdin and stdout (rewards/judge.py)."""
        contents = self._contents(program, files)
        limits = _limits(self.cfg, self.isolated)
        if self.isolated:
            proc, cgroups, group = _launch_isolated(
                self.cfg, self.python, self.python_binds, contents, limits, subprocess.PIPE
            )
            return Session(self.cfg, proc, cgroups, group)
        root = tempfile.mkdtemp(prefix="megatron_rl_unisolated_")
        try:
            proc = _launch_unisolated(self.python, contents, limits, root, subprocess.PIPE)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return Session(self.cfg, proc, None, None, cleanup=lambda: shutil.rmtree(root, ignore_errors=True))

    @staticmethod
    def _contents(program: str, files: Mapping[str, str | bytes] | None) -> dict[str, bytes]:
        contents: dict[str, bytes] = {"_launcher.py": LAUNCHER.encode(), "main.py": program.encode()}
        for name, data in (files or {}).items():
            if "/" in name or name.startswith(".") or name in contents:
                raise ValueError(f"sandbox file name {name!r} must be a plain name other than {list(contents)}")
            contents[name] = data.encode() if isinstance(data, str) else data
        return contents

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _run_isolated(
    cfg: SandboxConfig, python: str, python_binds: list[str], contents: dict[str, bytes], limits: str, stdin: bytes
) -> RunResult:
    stdin_fd = _memfd("stdin", stdin)
    try:
        proc, cgroups, group = _launch_isolated(cfg, python, python_binds, contents, limits, stdin_fd)
    finally:
        os.close(stdin_fd)
    try:
        result = _supervise(cfg, proc)
        # Any OOM kill means the sandbox went over its memory, even if the program survived the loss of a
        # child and exited 0.
        oom = group is not None and cgroups is not None and cgroups.oom_killed(group)
        if oom and result.status in ("ok", "crash"):
            result.status = "memory"
        return result
    finally:
        if cgroups is not None and group is not None:
            cgroups.remove(group)


def _launch_isolated(
    cfg: SandboxConfig, python: str, python_binds: list[str], contents: dict[str, bytes], limits: str, stdin: int
) -> tuple[subprocess.Popen[bytes], _Cgroups | None, list[str] | None]:
    """Start the program in bwrap (in its own cgroup when there is one), stdout and stderr piped; `stdin` is an
    fd or subprocess.PIPE. Returns once it runs: the process, and the cgroup manager and group to remove."""
    # Files and stdin travel as memfds: bwrap copies each into the sandbox's /sandbox, nothing touches the
    # host disk, and no host path has to be readable by the sandbox uid.
    fds = {name: _memfd(name, data) for name, data in contents.items()}
    argv = bwrap_argv(python, python_binds, fds) + [limits, "/sandbox", "main.py"]
    cgroups = _cgroups()
    group = cgroups.create(cfg) if cgroups is not None else None
    if group is not None:
        # The shell stops itself until we (root) have moved it into its cgroup and continued it: bwrap and
        # everything it starts are then born inside the cgroup.
        argv = ["/bin/sh", "-c", 'kill -STOP $$ && exec "$@"', "sh", *argv]
    as_root = os.geteuid() == 0
    try:
        proc = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(fds.values()),
            env={},
            start_new_session=True,
            # Drop to nobody before bwrap: an unprivileged bwrap maps the sandbox to this uid, so even an
            # escape lands as nobody, and RLIMIT_NPROC applies (root's processes are exempt from it).
            user=SANDBOX_UID if as_root else None,
            group=SANDBOX_UID if as_root else None,
            extra_groups=[] if as_root else None,
        )
    except BaseException:
        if cgroups is not None and group is not None:
            cgroups.remove(group)
        raise
    finally:
        for fd in fds.values():
            os.close(fd)
    if group is None:
        return proc, cgroups, group
    assert cgroups is not None
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            proc.returncode = os.waitstatus_to_exitcode(status)
            raise OSError(f"the sandbox's shell exited before starting bwrap (status {proc.returncode})")
        cgroups.attach(group, proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
    except BaseException:
        if proc.returncode is None:  # attaching failed: the stopped shell never started bwrap
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        cgroups.remove(group)
        raise
    return proc, cgroups, group


class Session:
    """A sandboxed program the host talks to while it runs: it writes to the program's stdin and reads its
    stdout (the code judge's two processes, rewards/judge.py). Same isolation and rlimits as `Sandbox.run`; the
    caller enforces wall time and output size and then calls `finish`, which kills what still runs, reaps it
    and classifies how it ended."""

    def __init__(
        self,
        cfg: SandboxConfig,
        proc: subprocess.Popen[bytes],
        cgroups: _Cgroups | None,
        group: list[str] | None,
        cleanup: Callable[[], None] | None = None,
    ) -> None:
        self.cfg, self.proc, self._cgroups, self._group, self._cleanup = cfg, proc, cgroups, group, cleanup
        self.start = time.monotonic()
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.stdin, self.stdout, self.stderr = proc.stdin.fileno(), proc.stdout.fileno(), proc.stderr.fileno()
        os.set_blocking(self.stdout, False)
        os.set_blocking(self.stderr, False)
        self.pidfd = os.pidfd_open(proc.pid)
        self._result: RunResult | None = None

    def finish(self, limit_hit: str = "", stderr: bytes = b"") -> RunResult:
        """Kill the program if it still runs (or `limit_hit`: 'timeout' or 'output_limit' is then its status),
        reap it, remove its cgroup. Idempotent."""
        if self._result is not None:
            return self._result
        proc = self.proc
        waited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if waited is None:
            _kill_tree(proc.pid)
            limit_hit = limit_hit or "crash"
        _, status_word, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status_word)
        for fd in (self.pidfd,):
            os.close(fd)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        cpu_s = usage.ru_utime + usage.ru_stime
        wall_s = time.monotonic() - self.start
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        status = limit_hit if waited is None or limit_hit else _classify(self.cfg, code, cpu_s)
        if self._cgroups is not None and self._group is not None:
            if status in ("ok", "crash") and self._cgroups.oom_killed(self._group):
                status = "memory"
            self._cgroups.remove(self._group)
        if self._cleanup is not None:
            self._cleanup()
        tail = stderr[-STDERR_TAIL_BYTES:]
        self._result = RunResult(status, None if waited is None else code, b"", tail, cpu_s, wall_s)
        return self._result


class _Cgroups:
    """One memory + pids cgroup per sandbox (cgroup v2, or v1's memory and pids hierarchies).

    Used when we are root and the hierarchy is writable: it caps the sandbox's total memory (all its
    processes, its tmpfs pages, kernel buffers) at memory_mb plus the scratch and /dev/shm sizes, and its
    process count, which per-process rlimits cannot do. The kernel OOM-kills inside the cgroup only.
    """

    NAME = "megatron_rl_sandbox"

    def __init__(self, roots: dict[str, str], version: int) -> None:
        self.roots = roots  # controller ("memory", "pids", or "" for v2's single tree) -> our parent directory
        self.version = version
        self._count = 0
        self._lock = threading.Lock()

    @classmethod
    def detect(cls) -> _Cgroups | None:
        if sys.platform != "linux" or os.geteuid() != 0:
            return None
        base = "/sys/fs/cgroup"
        try:
            if os.path.exists(f"{base}/cgroup.controllers"):
                with open(f"{base}/cgroup.controllers") as f:
                    if not {"memory", "pids"} <= set(f.read().split()):
                        return None
                parent = f"{base}/{cls.NAME}"
                os.makedirs(parent, exist_ok=True)
                for directory in (base, parent):
                    with open(f"{directory}/cgroup.subtree_control", "w") as f:
                        f.write("+memory +pids")
                groups = cls({"": parent}, 2)
            elif os.path.exists(f"{base}/memory/cgroup.procs") and os.path.exists(f"{base}/pids/cgroup.procs"):
                roots = {c: f"{base}/{c}/{cls.NAME}" for c in ("memory", "pids")}
                for parent in roots.values():
                    os.makedirs(parent, exist_ok=True)
                groups = cls(roots, 1)
            else:
                return None
            groups._remove_stale()
            return groups
        except OSError as exc:
            log.warning("code sandbox: no cgroup (%s); total memory is limited per process only", exc)
            return None

    def create(self, cfg: SandboxConfig) -> list[str]:
        with self._lock:
            self._count += 1
            name = f"{os.getpid()}-{self._count}"
        memory = (cfg.memory_mb << 20) + SCRATCH_BYTES + SHM_BYTES
        pids = cfg.max_processes + 2  # + the shell/bwrap outside the namespace and a margin for bwrap's fork
        dirs = [f"{root}/{name}" for root in self.roots.values()]
        for directory in dirs:
            os.mkdir(directory)
        if self.version == 2:
            self._write(dirs[0], "memory.max", memory)
            self._write(dirs[0], "memory.swap.max", 0, optional=True)
            self._write(dirs[0], "pids.max", pids)
        else:
            memory_dir, pids_dir = dirs
            self._write(memory_dir, "memory.limit_in_bytes", memory)
            self._write(memory_dir, "memory.memsw.limit_in_bytes", memory, optional=True)
            self._write(pids_dir, "pids.max", pids)
        return dirs

    def attach(self, dirs: list[str], pid: int) -> None:
        for directory in dirs:
            self._write(directory, "cgroup.procs", pid)

    def oom_killed(self, dirs: list[str]) -> bool:
        """Whether the kernel killed a process of this cgroup for memory."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(f"{dirs[0]}/{name}") as f:
                counts = dict(line.split() for line in f if len(line.split()) == 2)
        except OSError:
            return False
        return int(counts.get("oom_kill", "0")) > 0

    def remove(self, dirs: list[str]) -> None:
        # The processes are dead (the PID namespace ends before bwrap exits); the kernel may still be
        # uncharging them, so retry briefly.
        for directory in dirs:
            for attempt in range(100):
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 99:
                        log.warning("code sandbox: could not remove cgroup %s", directory)
                    time.sleep(0.01)

    def _remove_stale(self) -> None:
        """Empty cgroups left by processes that died mid-run."""
        for root in self.roots.values():
            for name in os.listdir(root):
                owner = name.split("-", 1)[0]
                if owner.isdigit() and not psutil.pid_exists(int(owner)):
                    with contextlib.suppress(OSError):
                        os.rmdir(f"{root}/{name}")

    @staticmethod
    def _write(directory: str, name: str, value: int, optional: bool = False) -> None:
        path = f"{directory}/{name}"
        if optional and not os.path.exists(path):
            return
        with open(path, "w") as f:
            f.write(str(value))


_cgroups_lock = threading.Lock()
_cgroups_state: list[_Cgroups | None] = []


def _cgroups() -> _Cgroups | None:
    """The process's cgroup manager, detected once (None: not root, or no writable memory+pids hierarchy)."""
    if not USE_CGROUPS:
        return None
    with _cgroups_lock:
        if not _cgroups_state:
            _cgroups_state.append(_Cgroups.detect())
        return _cgroups_state[0]


def _run_unisolated(
    cfg: SandboxConfig, python: str, contents: dict[str, bytes], limits: str, stdin: bytes
) -> RunResult:
    with tempfile.TemporaryDirectory(prefix="megatron_rl_unisolated_") as root:
        stdin_fd = _memfd("stdin", stdin)
        try:
            proc = _launch_unisolated(python, contents, limits, root, stdin_fd)
        finally:
            os.close(stdin_fd)
        return _supervise(cfg, proc)


def _launch_unisolated(
    python: str, contents: dict[str, bytes], limits: str, root: str, stdin: int
) -> subprocess.Popen[bytes]:
    code_dir = os.path.join(root, "sandbox")
    scratch = os.path.join(root, "tmp")
    os.mkdir(code_dir)
    os.mkdir(scratch)
    for name, data in contents.items():
        with open(os.path.join(code_dir, name), "wb") as f:
            f.write(data)
    return subprocess.Popen(
        [python, "-I", os.path.join(code_dir, "_launcher.py"), limits, code_dir, "main.py"],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=scratch,
        env={"PATH": "/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8"},
        start_new_session=True,
    )


def _supervise(cfg: SandboxConfig, proc: subprocess.Popen[bytes]) -> RunResult:
    """Collect output under the wall-time and output limits, kill on either, classify the exit."""
    start = time.monotonic()
    deadline = start + cfg.wall_time_s
    try:
        stdout, stderr, limit_hit, waited = _collect(proc, deadline, cfg.max_output_bytes)
    except BaseException:  # e.g. KeyboardInterrupt: never leave a sandbox running behind us
        _kill_tree(proc.pid)
        proc.wait()
        raise
    if waited is None:
        _kill_tree(proc.pid)
        _, status_word, usage = os.wait4(proc.pid, 0)
    else:
        status_word, usage = waited
        if limit_hit:
            # It exited, but something it started holds the pipes (possible only unisolated, where no PID
            # namespace ends with it): its process group is what we can still reach.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    # We reaped the process ourselves (for its rusage); tell Popen so it does not wait again.
    proc.returncode = os.waitstatus_to_exitcode(status_word)
    for pipe in (proc.stdout, proc.stderr):
        assert pipe is not None
        pipe.close()
    cpu_s = usage.ru_utime + usage.ru_stime
    wall_s = time.monotonic() - start
    tail = bytes(stderr[-STDERR_TAIL_BYTES:])
    if limit_hit:
        return RunResult(limit_hit, None, bytes(stdout), tail, cpu_s, wall_s)
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    return RunResult(_classify(cfg, code, cpu_s), code, bytes(stdout), tail, cpu_s, wall_s)


def _classify(cfg: SandboxConfig, code: int, cpu_s: float) -> str:
    if code == 0:
        return "ok"
    if code == EXIT_COMPILE_ERROR:
        return "compile_error"
    if code == EXIT_MEMORY:
        return "memory"
    # RLIMIT_CPU ends a program with SIGXCPU, or SIGKILL at the hard limit when it is PID 1 or ignores
    # SIGXCPU; a SIGKILL well before the CPU limit is something else (a crash).
    if code - 128 in (signal.SIGXCPU, signal.SIGKILL) and cpu_s >= 0.95 * max(1, math.ceil(cfg.cpu_time_s)):
        return "timeout"
    return "crash"


def bwrap_argv(python: str, python_binds: list[str], files: Mapping[str, int]) -> list[str]:
    """The bubblewrap command line, up to the launcher's arguments; `files` are fds copied into /sandbox."""
    argv = [
        "bwrap",
        # New user, network, PID, IPC, UTS and cgroup namespaces; no user namespaces inside.
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--as-pid-1",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--hostname",
        "sandbox",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--ro-bind",
        "/usr",
        "/usr",
        *_root_layout(),
        *python_binds,
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(SCRATCH_BYTES),
        "--tmpfs",
        "/tmp",
        "--size",
        str(SHM_BYTES),
        "--tmpfs",
        "/dev/shm",
        "--dir",
        "/sandbox",
    ]
    for name, fd in files.items():
        argv += ["--file", str(fd), f"/sandbox/{name}"]
    # Last: everything above is set up, now the root (and /sandbox in it) becomes read-only; /tmp and
    # /dev/shm are separate mounts and stay writable.
    argv += ["--remount-ro", "/", "--chdir", "/tmp", "--", python, "-I", "/sandbox/_launcher.py"]
    return argv


def _collect(
    proc: subprocess.Popen[bytes], deadline: float, max_bytes: int
) -> tuple[bytearray, bytearray, str, tuple[int, resource.struct_rusage] | None]:
    """Read stdout and stderr until both close and the process exits; stop early at the deadline or past
    `max_bytes` in total. Returns (stdout, stderr, limit hit or "", (wait status, rusage) if it exited).

    The exit is watched through a pidfd, so neither a program that closes its pipes and keeps running nor
    one that exits while a child holds them open needs polling.
    """
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    buffers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    pidfd = os.pidfd_open(proc.pid)
    waited = None
    try:
        with selectors.DefaultSelector() as selector:
            for fd in (*buffers, pidfd):
                selector.register(fd, selectors.EVENT_READ)
            total = 0
            while len(selector.get_map()) > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return out, err, "timeout", waited
                for key, _ in selector.select(remaining):
                    if key.fd == pidfd:
                        _, status, usage = os.wait4(proc.pid, 0)  # it has exited: does not block
                        waited = (status, usage)
                        selector.unregister(pidfd)
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                        continue
                    total += len(chunk)
                    if total > max_bytes:
                        return out, err, "output_limit", waited
                    buffer = buffers[key.fd]
                    buffer += chunk
                    if buffer is err and len(err) > 2 * STDERR_TAIL_BYTES:
                        del err[:-STDERR_TAIL_BYTES]
    finally:
        os.close(pidfd)
    return out, err, "", waited


def _kill_tree(pid: int) -> None:
    """SIGKILL a sandbox: its process group, and its descendants by pid.

    Killing the PID-namespace init (bwrap's child) from the host makes the kernel kill every process in
    the namespace, including ones that left the process group with setsid(). Unisolated, a descendant
    that double-forked away is no longer our descendant and survives (documented above).
    """
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.send_signal(signal.SIGKILL)
    # A killed descendant whose parent (bwrap) is gone too is reaped by the host's init, which may take a
    # while: a zombie no longer runs, so it counts as gone.
    deadline = time.monotonic() + 10.0
    alive = descendants
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        if alive:
            time.sleep(0.01)
    if alive:
        log.error("sandbox processes survived SIGKILL: %s", [p.pid for p in alive])


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_probe_lock = threading.Lock()
_probe_results: dict[tuple, str | None] = {}


def isolation_problem(cfg: SandboxConfig) -> str | None:
    """Why bubblewrap isolation does not work here (None if it does); probed once per process and limits."""
    key = dataclasses.astuple(cfg)
    with _probe_lock:
        if key not in _probe_results:
            _probe_results[key] = _probe(cfg)
        return _probe_results[key]


def _probe(cfg: SandboxConfig) -> str | None:
    if sys.platform != "linux":
        return f"bubblewrap needs Linux, this is {sys.platform}"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    python, binds = sandbox_python()
    limits = _limits(cfg, True)
    contents = {"_launcher.py": LAUNCHER.encode(), "main.py": b"print('sandbox ok')"}
    try:
        result = _run_isolated(
            dataclasses.replace(cfg, wall_time_s=max(cfg.wall_time_s, 30.0)), python, binds, contents, limits, b""
        )
    except OSError as exc:
        return f"starting bwrap failed: {exc}"
    if result.status != "ok" or result.stdout != b"sandbox ok\n":
        detail = result.stderr.decode(errors="replace").strip()[-500:]
        hint = ""
        if "namespace" in detail or "Operation not permitted" in detail:
            hint = (
                " (unprivileged user namespaces look disabled: see sysctls user.max_user_namespaces,"
                " kernel.unprivileged_userns_clone, kernel.apparmor_restrict_unprivileged_userns)"
            )
        return f"bwrap could not start a sandbox (status {result.status}, exit {result.exit_code}): {detail}{hint}"
    return None


_sandboxes: dict[tuple, Sandbox] = {}
_sandboxes_lock = threading.Lock()


def get_sandbox(cfg: SandboxConfig) -> Sandbox:
    """The process's sandbox pool for these limits (created on first use; raises SandboxUnavailable)."""
    key = dataclasses.astuple(cfg)
    with _sandboxes_lock:
        if key not in _sandboxes:
            _sandboxes[key] = Sandbox(cfg)
        return _sandboxes[key]
