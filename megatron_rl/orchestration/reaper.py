"""Nothing outlives a dead driver: a watcher process that ends every process of the run when the driver dies.

    reaper = Reaper.start()     # in the driver, before anything else is started
    ...                         # Ray, engines, reward workers, sandboxes: all inherit the run's tag
    reaper.stop(10.0)           # a clean end: the watcher leaves; stragglers of the run's own shutdown
                                # still alive after 10 s are killed here

The driver tags its environment with a run id (`MEGATRON_RL_RUN_ID`) before it starts anything, so every
process it starts inherits the tag: Ray's local head (GCS, raylet, the dashboard and runtime-env agents,
the workers), the SGLang servers and their schedulers, the reward worker processes and the sandboxes they
run; the SGLang servers' scratch directories carry the run id in their names (`megatron_rl-<run id[:8]>-*`
in the temp directory). The watcher runs in a session of its own, without the tag, and blocks on the read end
of a pipe whose write end only the driver holds. A driver that dies for any reason, SIGKILL included (the OOM
killer, a lost `scancel --signal=KILL`), closes the pipe: the watcher then SIGKILLs every process that
carries the tag and every descendant of one, until none is left, and removes the run's scratch directories.
Descendants count whatever their environment: Ray's raylet starts its dashboard and runtime-env agents with
an environment of its own, without the tag. While the driver lives the watcher notes the run's processes
every 2 s, so an orphan whose tagged parent died first is still ended. A driver that ends cleanly writes a
byte first and the watcher exits without a sweep; the driver has shut down what it started (Ray included,
if it started Ray) and waits for its processes to be gone, killing any straggler itself. Until then the
watcher stands guard, so a driver killed in the middle of its own shutdown leaves nothing either.

Without the watcher, a SIGKILLed driver leaves Ray's dashboard and runtime-env agents and the reward
workers running (measured on CPU: 5 of the 15 processes of a run; Ray's own fate sharing ends the rest).

On a cluster (Ray started by the Slurm script) the watcher sweeps the driver's node: the reward workers and
sandboxes. The trainer and engine actors on every node are Ray's: a job's actors die with its driver, and
Ray ends a dead worker's child processes (the SGLang server). `/proc/<pid>/environ` is readable for the
run's own user's processes, which are the only ones tagged.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from multiprocessing import resource_tracker
from pathlib import Path

TAG = "MEGATRON_RL_RUN_ID"
CLEAN_EXIT = b"q"


class Reaper:
    def __init__(self, run_id: str, process: subprocess.Popen[bytes], write_fd: int) -> None:
        self.run_id, self.process, self.write_fd = run_id, process, write_fd

    @classmethod
    def start(cls) -> Reaper:
        """Tag this process's environment and start the watcher (its own session, untagged)."""
        run_id = uuid.uuid4().hex
        read_fd, write_fd = os.pipe()  # both close-on-exec: no child started later inherits the write end
        env = {k: v for k, v in os.environ.items() if k != TAG}
        process = subprocess.Popen(
            [sys.executable, "-m", "megatron_rl.orchestration.reaper", run_id, str(read_fd)],
            pass_fds=(read_fd,),
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        os.close(read_fd)
        os.environ[TAG] = run_id
        return cls(run_id, process, write_fd)

    def stop(self, leftovers_grace_s: float | None = None) -> list[str]:
        """A clean end: the watcher exits without a sweep and this process is untagged again. With
        `leftovers_grace_s`, processes of the run still alive after that long (the run's own shutdown should
        have ended them all: a reward worker slow to exit) are killed here; returns them ("pid command")."""
        if os.environ.get(TAG) == self.run_id:
            del os.environ[TAG]
        if self.write_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.write_fd, CLEAN_EXIT)
            os.close(self.write_fd)
            self.write_fd = -1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if leftovers_grace_s is None:
            return []
        # multiprocessing's resource tracker is this process's own helper: it exits with it, not with the run.
        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        spared = {tracker} if tracker else set()
        deadline = time.monotonic() + leftovers_grace_s
        while set(run_processes(self.run_id)) - spared and time.monotonic() < deadline:
            time.sleep(0.1)
        return sweep(self.run_id, quiet_s=0.5, watch_s=0.0, spared=spared)


def tagged(run_id: str) -> set[int]:
    """Pids of the processes whose environment carries the run's tag (this one excluded)."""
    needle = f"{TAG}={run_id}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def run_processes(run_id: str) -> dict[int, int]:
    """The run's live processes, pid -> start time: the tagged ones and all their descendants. Descendants
    count whatever their environment: Ray's raylet starts its dashboard and runtime-env agents with an
    environment of its own making, without the tag."""
    stats = {
        pid: st for pid in (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()) if (st := _stat(pid))
    }
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), [pid for pid in tagged(run_id) if pid in stats]
    while todo:
        pid = todo.pop()
        if pid not in found and pid != os.getpid():
            found.add(pid)
            todo += children.get(pid, [])
    return {pid: stats[pid][1] for pid in found}


def sweep(
    run_id: str,
    timeout_s: float = 60.0,
    quiet_s: float = 3.0,
    watch_s: float = 15.0,
    known: dict[int, int] | None = None,
    spared: set[int] | None = None,
) -> list[str]:
    """SIGKILL the run's processes (`run_processes`, and those of `known`, pid -> start time, that still
    run: a snapshot taken while the driver lived, for orphans whose tagged parent died first) until none has
    been seen for `quiet_s` and `watch_s` have passed, or `timeout_s` passed; returns what was killed
    ("pid command"). A process being spawned when its parent was killed appears a moment later, hence the
    watch. Pids in `spared` are left alone."""
    killed: dict[int, str] = {}
    start = last_seen = time.monotonic()
    known = dict(known or {})

    def watching() -> bool:
        now = time.monotonic()
        return (now - last_seen < quiet_s or now - start < watch_s) and now - start < timeout_s

    while watching():
        alive = {pid: st for pid, st in run_processes(run_id).items() if pid not in (spared or ())}
        for pid, started in known.items():
            if (st := _stat(pid)) is not None and st[1] == started:  # the same process, not a reused pid
                alive[pid] = started
        if alive:
            last_seen = time.monotonic()
        for pid in alive:
            if pid not in killed:
                with contextlib.suppress(OSError):
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    killed[pid] = f"{pid} {command.strip()[:100]}"
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    return list(killed.values())


def remove_scratch(run_id: str) -> None:
    """Remove the run's scratch directories in the temp directory (`megatron_rl-<run id[:8]>-*`: the SGLang
    servers' temp directories, generator/server.py `scratch_prefix`), which a server's own stop() removes but a
    killed driver never reaches."""
    for path in Path(tempfile.gettempdir()).glob(f"megatron_rl-{run_id[:8]}-*"):
        shutil.rmtree(path, ignore_errors=True)


SNAPSHOT_S = 2.0
"""While the driver lives, the watcher notes the run's processes this often (for `sweep`'s `known`)."""


def main(argv: list[str]) -> int:
    run_id, read_fd = argv[0], int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the driver's terminal is the driver's to handle
    message = b""
    known: dict[int, int] = {}
    while True:
        ready, _, _ = select.select([read_fd], [], [], SNAPSHOT_S)
        if not ready:  # note the run's processes, keeping those noted before that still run (orphans)
            known = {pid: t for pid, t in known.items() if (st := _stat(pid)) is not None and st[1] == t}
            known.update(run_processes(run_id))
            continue
        try:
            chunk = os.read(read_fd, 1)
        except InterruptedError:
            continue
        if not chunk:
            break
        message += chunk
    if CLEAN_EXIT in message:
        return 0
    killed = sweep(run_id, known=known)
    remove_scratch(run_id)  # after the sweep: nothing of the run uses them any more
    if killed:
        print(f"megatron-rl: the driver died; ended {len(killed)} processes of its run", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
