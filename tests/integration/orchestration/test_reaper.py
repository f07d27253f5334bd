"""A driver killed with SIGKILL takes the processes it started with it (orchestration/reaper.py).

The driver here is a small Python process that starts the watcher, then children that would otherwise
outlive it: each in a session of its own (as Ray's agents and the SGLang servers are), one of them a
grandchild, and grandchildren started without the run's tag (as Ray's raylet starts its agents), one of
them orphaned before the driver dies. Nothing is faked: the driver is SIGKILLed and the real watcher sweeps.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from megatron_rl.generator.server import RUN_TAG, make_scratch
    from megatron_rl.orchestration.reaper import Reaper

    reaper = Reaper.start()
    # A server's scratch directory, as SGLangServer.start() makes one, with a file SGLang would leave in it.
    scratch = make_scratch(os.environ[RUN_TAG])
    (scratch / "tmpzmqsocket").touch()
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    spawn = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:], start_new_session=True); time.sleep(600)"
    nested = [sys.executable, "-c", spawn, *sleeper]
    children = [subprocess.Popen(sleeper, start_new_session=True), subprocess.Popen(nested, start_new_session=True)]
    # As Ray's raylet starts its agents: grandchildren with an environment of their own (no tag), one under a
    # parent that stays, one orphaned when its parent exits after 5 s, before the driver is killed (a raylet
    # that died first).
    token = sys.argv[2]
    clean = "import os, subprocess, sys; "
    clean += "subprocess.Popen(sys.argv[2:], env={'PATH': os.environ['PATH']}, start_new_session=True)"
    untagged = sleeper + [token]
    subprocess.Popen([sys.executable, "-c", clean + "; __import__('time').sleep(600)", "x", *untagged])
    subprocess.Popen([sys.executable, "-c", clean + "; __import__('time').sleep(5)", "x", *untagged])
    print(scratch, flush=True)
    print(reaper.process.pid, *(c.pid for c in children), flush=True)
    if sys.argv[1] == "clean":
        reaper.stop()
        print("stopped", flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _tagged_pids(run_marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if run_marker.encode() in (entry / "environ").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return [p for p in pids if _alive(p)]


def _with_token(token: str) -> list[int]:
    """Live sleepers with `token` as their argument (the untagged grandchildren)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if argv[2:4] == [b"import time; time.sleep(600)", token.encode()]:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return [p for p in pids if _alive(p)]


def _start_driver(mode: str, token: str = "-") -> tuple[subprocess.Popen, list[int], Path]:
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, mode, token], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    scratch = Path(driver.stdout.readline().strip())
    reaper_pid, *children = map(int, driver.stdout.readline().split())
    return driver, [reaper_pid, *children], scratch


def _wait_until(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_processes_started_by_a_sigkilled_driver_are_ended():
    token = f"untagged-{uuid.uuid4().hex}"
    driver, (reaper, *children), scratch = _start_driver("kill", token)
    assert scratch.is_dir() and scratch.name.startswith("megatron_rl-")
    tag = Path(f"/proc/{children[0]}/environ").read_bytes().split(b"MEGATRON_RL_RUN_ID=")[1].split(b"\0")[0]
    # two children and a grandchild (/proc shows the driver's environment as it was at exec: untagged), and
    # the spawner of an untagged grandchild that stays
    assert _wait_until(lambda: len(_tagged_pids(tag.decode())) == 4)
    assert _wait_until(lambda: len(_with_token(token)) == 2)  # the untagged grandchildren
    # The watcher notes the run's processes every 2 s: the orphan-to-be is among them before its parent exits.
    time.sleep(7)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    assert _wait_until(lambda: not _tagged_pids(tag.decode())), _tagged_pids(tag.decode())
    assert _wait_until(lambda: not _with_token(token)), "an untagged descendant of the run outlived it"
    # A process of the run that appears late (spawned as its parent was killed), after 3 quiet seconds, is
    # still ended: the watcher keeps sweeping for 15 s.
    time.sleep(5)
    late = subprocess.Popen(["sleep", "60"], env={**os.environ, "MEGATRON_RL_RUN_ID": tag.decode()})
    assert _wait_until(lambda: late.poll() is not None, timeout_s=12), "a late process of the run outlived it"
    assert late.returncode == -signal.SIGKILL
    assert _wait_until(lambda: not _alive(reaper), timeout_s=20)  # the watcher leaves after its watch
    assert not scratch.exists(), "the run's scratch directory outlived it"


def test_a_clean_stop_leaves_the_processes_alone():
    driver, (reaper, *children), scratch = _start_driver("clean")
    try:
        assert driver.stdout.readline().strip() == "stopped"
        assert _wait_until(lambda: not _alive(reaper))
        assert all(_alive(pid) for pid in children)
        assert scratch.is_dir()  # a live run's servers remove their own
        assert "MEGATRON_RL_RUN_ID" not in os.environ
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()


@pytest.fixture(autouse=True)
def _no_stray_tag():
    os.environ.pop("MEGATRON_RL_RUN_ID", None)
    yield
