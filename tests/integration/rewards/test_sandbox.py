"""The code sandbox against an escape corpus: every attempt is contained, with the right failure reason,
and the host is unchanged afterwards (no processes left, no files written outside the scratch directory).

Needs bubblewrap (tools/install_sandbox.sh); without it these tests skip and one test checks the refusal.
"""

import dataclasses
import os
import socket
import subprocess
import time
import uuid

import psutil
import pytest

from megatron_rl.config import SandboxConfig
from megatron_rl.rewards import sandbox as sandbox_module
from megatron_rl.rewards.sandbox import Sandbox, SandboxUnavailable, get_sandbox, isolation_problem

# Generous wall time: the CI machine has 2 cores shared with other tests; limits are about containment.
CFG = SandboxConfig(wall_time_s=20.0, cpu_time_s=2.0, memory_mb=256, max_processes=8, max_output_bytes=1 << 16)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

needs_isolation = pytest.mark.skipif(
    isolation_problem(CFG) is not None, reason=f"no isolation here: {isolation_problem(CFG)}"
)


def sandbox_processes() -> list[psutil.Process]:
    """Live processes that belong to a sandbox: bwrap, or anything running as the sandbox uid."""
    found = []
    for process in psutil.process_iter(["name", "uids", "status"]):
        info = process.info
        if info["status"] == psutil.STATUS_ZOMBIE or info["uids"] is None:
            continue
        if info["name"] == "bwrap" or sandbox_module.SANDBOX_UID in (info["uids"].real, info["uids"].effective):
            found.append(process)
    return found


def ours_or_orphaned(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The sandbox processes started by this test process, or orphaned (reparented to init: escaped).

    Sandboxes of another test run on the same machine hang under that run's Python process and are
    ignored, so concurrent runs do not make each other fail.
    """
    found = []
    for process in processes:
        try:
            top = process
            while (parent := top.parent()) is not None and parent in processes:
                top = parent
            if top.ppid() in (os.getpid(), 1):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture
def box():
    """The sandbox pool, and the check that the host is clean after the test."""
    assert ours_or_orphaned(sandbox_processes()) == []
    yield get_sandbox(CFG)
    leftover = ours_or_orphaned(sandbox_processes())
    assert leftover == [], [(p.pid, p.info["name"]) for p in leftover]


@needs_isolation
def test_correct_program_runs(box):
    result = box.run("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin=b"1 2 3\n")
    assert (result.status, result.exit_code, result.stdout) == ("ok", 0, b"6\n")
    with pytest.raises(ValueError, match="plain name"):
        box.run("print(1)", files={"../x": "1"})


@needs_isolation
def test_compile_error_and_crash_are_told_apart(box):
    assert box.run("def f(:\n  pass").status == "compile_error"
    assert box.run("raise ValueError('boom')").status == "crash"
    assert box.run("import sys; sys.exit(3)").exit_code == 3


@needs_isolation
def test_network_is_unreachable(box):
    # A listener on the host's loopback: the sandbox has its own loopback, so it never gets a connection.
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.settimeout(0.5)
    program = f"""
import socket
for address in [("1.1.1.1", 80), ("127.0.0.1", {port})]:
    try:
        socket.create_connection(address, timeout=2)
        print("CONNECTED", address)
    except OSError as exc:
        print("blocked", address, type(exc).__name__)
socket.create_connection(("8.8.8.8", 53), timeout=2)
"""
    result = box.run(program)
    server_accepted = True
    try:
        server.accept()
    except TimeoutError:
        server_accepted = False
    finally:
        server.close()
    assert result.status == "crash"
    assert b"CONNECTED" not in result.stdout and result.stdout.count(b"blocked") == 2
    assert not server_accepted


@needs_isolation
def test_cannot_write_outside_scratch(box):
    marker = f"megatron_rl_escape_{uuid.uuid4().hex}"
    targets = [f"/tmp/{marker}", f"/dev/shm/{marker}", f"/sandbox/{marker}", f"{REPO}/{marker}", f"/{marker}"]
    program = f"""
import os
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        print("wrote", path)
    except OSError as exc:
        print("refused", path, type(exc).__name__)
open({REPO + "/" + marker!r}, "w")
"""
    result = box.run(program)
    assert result.status == "crash"
    # Scratch (/tmp) and /dev/shm are writable inside, and private: nothing of it reaches the host.
    assert f"wrote /tmp/{marker}".encode() in result.stdout
    for path in targets + [f"/root/{marker}"]:
        assert not os.path.exists(path), path


@needs_isolation
def test_secrets_are_not_readable(box, tmp_path, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("MEGATRON_RL_TEST_SECRET", secret)
    host_file = tmp_path / "secret.txt"
    host_file.write_text(secret)
    host_file.chmod(0o644)
    tmp_path.chmod(0o755)
    paths = [str(host_file), "/etc/shadow", "/etc/passwd", "/root/.bashrc", f"{REPO}/pyproject.toml",
             f"/proc/{os.getpid()}/environ", "/proc/1/environ", f"/proc/{os.getppid()}/cmdline"]  # fmt: skip
    program = f"""
import os
print(dict(os.environ))
print(sorted(os.listdir("/")), sorted(os.listdir("/proc"))[:50])
for path in {paths!r}:
    try:
        with open(path, "rb") as f:
            print("READ", path, f.read()[:200])
    except OSError as exc:
        print("denied", path, type(exc).__name__)
open({str(host_file)!r})
"""
    result = box.run(program)
    assert result.status == "crash"
    assert secret.encode() not in result.stdout + result.stderr
    assert b"MEGATRON_RL_TEST_SECRET" not in result.stdout
    # Only the program's own /proc/1 is there: the host's files and processes are absent.
    read = [line for line in result.stdout.splitlines() if line.startswith(b"READ")]
    assert all(line.startswith(b"READ /proc/1/environ") for line in read), read
    assert b"'work'" not in result.stdout and b"'root'" not in result.stdout and b"'etc'" not in result.stdout


@needs_isolation
def test_fork_bomb_is_contained(box):
    result = box.run("import os\nwhile True:\n    os.fork()")
    assert result.status == "crash"
    assert b"BlockingIOError" in result.stderr


@needs_isolation
def test_fork_bomb_does_not_starve_other_sandboxes(box):
    # The process limit counts per sandbox (its own user namespace, and its own pids cgroup when root):
    # a sandbox holding all its processes leaves the others free to start.
    hog = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(3)
            os._exit(0)
        children += 1
except BlockingIOError:
    pass
time.sleep(3)
print(children)
"""
    hogging = box.submit(hog)
    time.sleep(1.0)  # let it reach its limit; not a timing assertion
    running = ours_or_orphaned(sandbox_processes())
    others = box.map([(f"print({i})", b"") for i in range(3)])
    assert [r.stdout for r in others] == [b"0\n", b"1\n", b"2\n"]
    result = hogging.result()
    assert result.status == "ok" and 0 < int(result.stdout) < CFG.max_processes
    if os.geteuid() == 0:  # outside its namespaces too, the sandbox is nobody, never root
        assert running and {p.info["uids"].real for p in running} == {sandbox_module.SANDBOX_UID}


@needs_isolation
def test_memory_bomb_is_contained(box):
    assert box.run("blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))").status == "memory"
    assert box.run("x = bytearray(10 ** 12)").status == "memory"


@needs_isolation
@pytest.mark.skipif(sandbox_module._cgroups() is None, reason="no writable memory+pids cgroup (needs root)")
def test_forking_memory_bomb_is_capped_in_total(box):
    # Each child stays under the per-process RLIMIT_AS; together they exceed the sandbox's cgroup.
    program = """
import os, time
children = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = bytearray(200 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(1)
        os._exit(0)
    children.append(pid)
print([os.waitpid(pid, 0)[1] for pid in children])
"""
    result = box.run(program)
    assert result.status == "memory"
    one_process = "block = bytearray(200 << 20)\nfor i in range(0, len(block), 4096):\n    block[i] = 1"
    assert box.run(one_process).status == "ok"
    for root in sandbox_module._cgroups().roots.values():  # every per-run cgroup is removed again
        assert [name for name in os.listdir(root) if name.startswith(f"{os.getpid()}-")] == []


@needs_isolation
def test_infinite_loop_times_out(box):
    result = box.run("while True:\n    pass")
    assert result.status == "timeout"


@needs_isolation
def test_sleeping_program_hits_the_wall_clock():
    box = Sandbox(SandboxConfig(wall_time_s=1.0, cpu_time_s=1.0, memory_mb=256))
    try:
        assert box.run("import time\ntime.sleep(60)").status == "timeout"
    finally:
        box.close()
    assert ours_or_orphaned(sandbox_processes()) == []


@needs_isolation
def test_huge_output_is_cut(box):
    result = box.run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert result.status == "output_limit"
    assert len(result.stdout) <= CFG.max_output_bytes
    # Through stderr too, and as a file in scratch (RLIMIT_FSIZE).
    assert box.run("import sys\nwhile True:\n    sys.stderr.write('x' * 65536)").status == "output_limit"
    big_file = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 65536)"
    assert box.run(big_file).status == "crash"


@needs_isolation
def test_cannot_signal_the_parent_or_host_processes(box):
    # A host process running as the sandbox's own uid: the most a signal could reach.
    victim = subprocess.Popen(
        ["sleep", "60"], user=sandbox_module.SANDBOX_UID if os.geteuid() == 0 else None, start_new_session=True
    )
    try:
        program = f"""
import os, signal
for target in ({os.getpid()}, {os.getppid()}, {victim.pid}, os.getppid()):
    try:
        os.kill(target, signal.SIGKILL)
        print("signalled", target)
    except OSError as exc:
        print("refused", target, type(exc).__name__)
os.kill(-1, signal.SIGKILL)
os.killpg({os.getpgid(0)}, signal.SIGKILL)
"""
        result = box.run(program)
        assert victim.poll() is None  # still running
        assert result.status == "crash"
        for pid in (os.getpid(), victim.pid):
            assert f"refused {pid} ProcessLookupError".encode() in result.stdout
    finally:
        victim.kill()
        victim.wait()


@needs_isolation
def test_daemon_is_killed_with_the_program(box, tmp_path):
    marker = tmp_path / "daemon_was_here"
    program = f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(3)
        open({str(marker)!r}, "w")
        os._exit(0)
    os._exit(0)
print("parent exits")
"""
    result = box.run(program)
    assert (result.status, result.stdout) == ("ok", b"parent exits\n")
    # The fixture checks that no sandbox process is left; the daemon never gets to write.
    assert not marker.exists()


@needs_isolation
def test_killed_on_timeout_with_children(box):
    program = """
import os, time
for _ in range(4):
    if os.fork() == 0:
        os.setsid()
        break
time.sleep(60)
"""
    cfg = SandboxConfig(wall_time_s=1.5, cpu_time_s=1.0, memory_mb=256)
    short = Sandbox(cfg)
    try:
        assert short.run(program).status == "timeout"
    finally:
        short.close()


@needs_isolation
def test_pool_runs_many_concurrently(box):
    results = box.map([(f"print({i} * 2)", b"") for i in range(12)])
    assert [r.stdout for r in results] == [f"{i * 2}\n".encode() for i in range(12)]


def test_refuses_without_isolation(monkeypatch):
    monkeypatch.setattr(sandbox_module, "_probe_results", {})
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        Sandbox(CFG)


def test_unisolated_development_mode_is_loud(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module, "_probe_results", {})
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    box = Sandbox(dataclasses.replace(CFG, allow_unisolated=True))
    try:
        assert "UNISOLATED" in caplog.text
        assert not box.isolated
        assert box.run("print(int(input()) + 1)", stdin=b"41\n").stdout == b"42\n"
        assert box.run("while True:\n    pass").status == "timeout"
        assert box.run("import os\nprint(os.getcwd())").stdout.strip().endswith(b"/tmp")
    finally:
        box.close()


@needs_isolation
def test_a_judged_test_leaves_nothing_running(box):
    # Both of a judged test's sandboxes (the judge's and the solution's) end with it, daemons and threads included.
    from megatron_rl.rewards.judge import judge

    program = (
        "import os, subprocess, threading, time\n"
        "subprocess.Popen(['/usr/bin/python3', '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
        "def f(x):\n    return 21 * x\n"
    )
    assert judge(program, {"asserts": ["assert f(1) == 21", "assert f(2) == 0"]}, CFG) == [None, "wrong_answer"]
