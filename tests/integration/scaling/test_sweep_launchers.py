"""The local launcher signals only the processes the sweep recorded: a live process whose start time differs from the
recorded one (its pid reused) is left alone, and the recorded one is stopped (SIGTERM to it) or killed (SIGKILL to
its group, a child of it included)."""

from __future__ import annotations

import subprocess
import time

from megatron_rl.scaling.launchers import LocalLauncher, process_start_time
from megatron_rl.scaling.sweep import RunState


def _group() -> subprocess.Popen[bytes]:
    """A process in its own session with a child: `sh` that starts `sleep` in the background and waits."""
    return subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)


def _state(process: subprocess.Popen[bytes], start_time: int | None) -> RunState:
    return RunState("r", [], "scalerl-cpu", None, 10, status="running", pid=process.pid, pgid=process.pid,
                    start_time=start_time)  # fmt: skip


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_start_time(pid) is None:
            return True
        time.sleep(0.05)
    return False


def test_a_reused_pid_is_never_signalled_and_the_recorded_run_is(tmp_path):
    process = _group()
    try:
        time.sleep(0.2)  # the shell has started its child
        started = process_start_time(process.pid)
        assert started is not None
        launcher = LocalLauncher()  # a later sweep process: the run is not its child
        stranger = _state(process, started + 1)
        assert not launcher.alive(stranger)
        launcher.stop(stranger)
        launcher.stop(stranger, kill=True)
        time.sleep(0.3)
        assert process.poll() is None, "a process the sweep did not start was signalled"
        assert launcher.poll(stranger) is None  # the recorded process is gone (its pid belongs to another)

        ours = _state(process, started)
        assert launcher.alive(ours) and launcher.poll(ours) is False
        children = subprocess.run(["pgrep", "-g", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2, children  # sh and its sleep
        launcher.stop(ours, kill=True)
        assert all(_gone(int(pid)) or int(pid) == process.pid for pid in children)
        assert process.wait(timeout=10) == -9
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
