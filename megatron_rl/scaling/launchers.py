"""How `megatron-rl sweep` starts, watches and stops its runs: child processes on this machine, or Slurm jobs.

Both answer the same calls on a run's `RunState` (scaling/sweep.py):

    launch(spec, state, directory)   start the run into directory/<name>; record what identifies it in `state`
    poll(state) -> False | int | None
                                     False while it runs; its exit code once it ended (None: not known)
    alive(state) / attach(state)     a run an earlier sweep process started, still running, watched again
    stop(state, kill=False)          graceful stop (the run checkpoints), or kill after the grace

**Only what the sweep started is signalled.** Local runs start in their own session (`start_new_session`), so
pid = process group id; the process's start time (field 22 of /proc/PID/stat, clock ticks since boot) is recorded
with them, and a signal goes out only while the process with that pid has that start time: a pid the system
reused for another process is never signalled. The graceful stop is SIGTERM to `megatron-rl train` itself, which
checkpoints and ends the processes it started (orchestration/stop.py, orchestration/reaper.py); the kill after the
grace is SIGKILL to its whole process group.

**Slurm.** Each run is one `sbatch` of slurm/bootstrap.sh (or `launcher.script`) with RECIPE, MODEL, OVERRIDES,
RUN_NAME and OUTPUT_DIR in its environment, as the GPU launch scripts pass them. The bootstrap answers SIGTERM by
asking the run to checkpoint and then requeueing the job (a cluster's pre-emption must not lose it), so a stop is
two steps: `scancel --signal=TERM --batch JOB` (the run checkpoints, the job requeues itself), then `scancel JOB` once
the job is pending again or no longer running; only the recorded job id is ever cancelled.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from megatron_rl.scaling.sweep import RunSpec, RunState, Sweep

REPO = Path(__file__).resolve().parents[2]


def train_command(spec: RunSpec, directory: Path) -> list[str]:
    """`megatron-rl train` for one run of the sweep, into directory/<name>."""
    model = ["--model", spec.model] if spec.model else []
    return [
        sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", spec.recipe, *model, *spec.overrides,
        f"output_dir={directory}", f"name={spec.name}",
    ]  # fmt: skip


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when no such process runs (or it is a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] == "Z":
        return None
    return int(fields[19])


class LocalLauncher:
    """Runs as child processes of this sweep process (one session each)."""

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def log(self, state: RunState, directory: Path) -> Path:
        return directory / "logs" / f"{state.name}.log"

    def describe(self, state: RunState) -> str:
        return f"pid {state.pid}"

    def launch(self, spec: RunSpec, state: RunState, directory: Path) -> None:
        log = self.log(state, directory)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            out.write(f"$ {shlex.join(train_command(spec, directory))}\n".encode())
            out.flush()
            child = subprocess.Popen(
                train_command(spec, directory), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        self.children[state.name] = child
        state.pid, state.pgid, state.start_time = child.pid, child.pid, process_start_time(child.pid)
        state.job_id = None

    def _ours(self, state: RunState) -> bool:
        """The recorded process still runs (same pid, same start time) and leads the recorded group."""
        if state.pid is None or state.start_time is None:
            return False
        if process_start_time(state.pid) != state.start_time:
            return False
        try:
            return os.getpgid(state.pid) == state.pgid
        except ProcessLookupError:
            return False

    def alive(self, state: RunState) -> bool:
        return self._ours(state)

    def attach(self, state: RunState) -> None:
        """A run of an earlier sweep process: not our child, watched through /proc (its exit code is not known)."""

    def poll(self, state: RunState) -> bool | int | None:
        child = self.children.get(state.name)
        if child is not None and child.pid == state.pid:
            code = child.poll()
            return False if code is None else code
        return False if self._ours(state) else None

    def stop(self, state: RunState, kill: bool = False) -> None:
        child = self.children.get(state.name)
        if child is not None and child.pid == state.pid and child.poll() is not None:
            return  # ended (and reaped): its pid may belong to someone else now
        if child is None and not self._ours(state):
            return
        assert state.pid is not None and state.pgid is not None
        with contextlib.suppress(ProcessLookupError):  # ended between the check and the signal
            if kill:
                os.killpg(state.pgid, signal.SIGKILL)
            else:
                # The driver alone: it checkpoints, then shuts down Ray and the engines it started. SIGTERM to the
                # whole group also reached Ray's own processes, and a run stopped during start-up then died with
                # "node timed out during startup" instead of ending cleanly (exit 143).
                os.kill(state.pid, signal.SIGTERM)


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def parse_job(text: str) -> tuple[str | None, int | None, int]:
    """(JobState, exit code, restarts) from `scontrol show job` output; (None, None, 0) when the job is unknown."""
    state = re.search(r"JobState=(\S+)", text)
    code = re.search(r"ExitCode=(\d+):(\d+)", text)
    restarts = re.search(r"Restarts=(\d+)", text)
    if state is None:
        return None, None, 0
    exit_code = None
    if code is not None:
        exit_code = int(code.group(1)) or (128 + int(code.group(2)) if int(code.group(2)) else 0)
    return state.group(1), exit_code, int(restarts.group(1)) if restarts else 0


def sbatch_command(spec: RunSpec, sweep: Sweep, directory: Path) -> tuple[list[str], dict[str, str]]:
    """The sbatch argv and the environment entries it adds for one run (slurm/bootstrap.sh's variables)."""
    script = Path(sweep.slurm.get("script", REPO / "slurm" / "bootstrap.sh"))
    extra = [str(a) for a in sweep.slurm.get("sbatch_args", [])]
    argv = [
        "sbatch", "--parsable", f"--job-name={sweep.name}-{spec.name}",
        f"--output={directory / 'logs' / spec.name}-%j.out", "--open-mode=append", *extra, str(script),
    ]  # fmt: skip
    env = {
        "RECIPE": spec.recipe,
        "MODEL": spec.model or "",
        "OVERRIDES": " ".join(spec.overrides),
        "RUN_NAME": spec.name,
        "OUTPUT_DIR": str(directory),
    }
    return argv, env


class SlurmLauncher:
    """Each run is a Slurm job of slurm/bootstrap.sh."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep
        self.cancelled: set[str] = set()
        self.stopped_at: dict[str, int] = {}
        """Run -> the job's restart count when the stop was sent."""

    def log(self, state: RunState, directory: Path) -> Path:
        return directory / "logs" / f"{state.name}-{state.job_id}.out"

    def describe(self, state: RunState) -> str:
        return f"Slurm job {state.job_id}"

    def launch(self, spec: RunSpec, state: RunState, directory: Path) -> None:
        (directory / "logs").mkdir(parents=True, exist_ok=True)
        argv, env = sbatch_command(spec, self.sweep, directory)
        out = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, cwd=REPO)
        if out.returncode != 0:
            raise RuntimeError(f"sbatch for {spec.name} failed (exit code {out.returncode}): {out.stderr.strip()}")
        state.job_id = out.stdout.strip().split(";")[0]
        state.pid = state.pgid = state.start_time = None

    def _job(self, state: RunState) -> tuple[str | None, int | None, int]:
        out = subprocess.run(["scontrol", "show", "job", str(state.job_id)], capture_output=True, text=True)
        return parse_job(out.stdout) if out.returncode == 0 else (None, None, 0)

    def alive(self, state: RunState) -> bool:
        job_state, _, _ = self._job(state)
        return job_state is not None and job_state not in TERMINAL

    def attach(self, state: RunState) -> None:
        """Jobs are watched by id; nothing to do."""

    def poll(self, state: RunState) -> bool | int | None:
        job_state, code, restarts = self._job(state)
        if job_state is None:
            return None  # purged from the controller: ended, exit code not known
        if job_state in TERMINAL:
            return code
        requeued = job_state in ("PENDING", "REQUEUED") or restarts > self.stopped_at.get(state.name, restarts)
        if state.stop is not None and state.name not in self.cancelled and requeued:
            # The graceful stop requeued it (checkpoint written): cancel it. Pending, it runs nothing; started again
            # already (a poll missed the pending spell), it resumed from that checkpoint and is ended as a cancel ends
            # a job, which loses at most its start.
            subprocess.run(["scancel", str(state.job_id)], capture_output=True)
            self.cancelled.add(state.name)
        return False

    def stop(self, state: RunState, kill: bool = False) -> None:
        if state.job_id is None:
            return
        if not kill:
            self.stopped_at[state.name] = self._job(state)[2]
        argv = ["scancel", str(state.job_id)] if kill else ["scancel", "--signal=TERM", "--batch", str(state.job_id)]
        subprocess.run(argv, capture_output=True)


def build_launcher(sweep: Sweep) -> Any:
    return SlurmLauncher(sweep) if sweep.launcher == "slurm" else LocalLauncher()
