"""`sbatch` on a real single-node Slurm (Debian's slurmctld/slurmd/munge on localhost), CPU recipe.

The job runs slurm/bootstrap.sh — the same script the GPU launchers exec — which starts a Ray cluster,
checks the allocation and runs `megatron-rl train`. A second job gets Slurm's pre-timeout signal
(scancel --signal=USR1 --batch): it must checkpoint, requeue itself, and the requeued job must resume
from that checkpoint at the next step. The cluster binds each task to the CPUs its step asked for (task/affinity,
cores), as clusters that bind do: jobs whose `megatron-rl` is slurm_probe.py (the bootstrap's steps, a probe for
the run) check that the Ray node's tasks get all the job's CPUs, and that a failed step ends the job at once,
named. The GPU launch scripts are checked statically.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from small_run import small_run

from megatron_rl.cli import build_parser
from megatron_rl.config import load_config

ROOT = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent


def _sh(cmd: str, **kw) -> str:
    return subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True, **kw).stdout


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("starting slurmctld/slurmd needs root")
    out = subprocess.run(["bash", str(ROOT / "tools" / "slurm_localhost.sh"), "start"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    yield
    subprocess.run(["bash", str(ROOT / "tools" / "slurm_localhost.sh"), "stop"], capture_output=True)


def _node_free() -> None:
    """Waits until no job is left on the node (each test's jobs start at once and time their own end)."""
    deadline = time.time() + 180
    while queue := _sh("squeue -h -o '%i %T'").strip():
        assert time.time() < deadline, f"jobs still on the node after 180 s: {queue}"
        time.sleep(2)


def _submit(tmp: Path, name: str, overrides: str) -> str:
    _node_free()
    setup = tmp / "setup.sh"
    setup.write_text(f"export PATH={VENV_BIN}:$PATH\nexport PYTHONWARNINGS=ignore WANDB_MODE=offline\n")
    env = dict(
        os.environ,
        RECIPE="scalerl-cpu",
        OVERRIDES=overrides,
        RUN_NAME=name,
        OUTPUT_DIR=str(tmp / "runs"),
        MRL_SETUP=str(setup),
        MRL=str(VENV_BIN / "megatron-rl"),
        RAY_PORT=str(6380 + os.getpid() % 1000),
    )
    out = _sh(
        f"sbatch --parsable --job-name={name} --nodes=1 --cpus-per-task=2 --requeue "
        f"--output={tmp}/{name}-%j.out {ROOT}/slurm/bootstrap.sh",
        env=env,
        cwd=tmp,
    )
    return out.strip().split(";")[0]


PROBE = Path(__file__).with_name("slurm_probe.py")


def _submit_probe(tmp: Path, name: str, fake_ray: str | None = None, **env: str) -> str:
    """A job of the bootstrap whose `megatron-rl` is slurm_probe.py; `fake_ray`: a `ray` command (a shell script's
    body) first on PATH, a fault injected into the Ray steps."""
    _node_free()
    path = f"{VENV_BIN}:$PATH"
    if fake_ray is not None:
        (tmp / "bin").mkdir()
        (tmp / "bin" / "ray").write_text(f"#!/bin/sh\n{fake_ray}\n")
        (tmp / "bin" / "ray").chmod(0o755)
        path = f"{tmp / 'bin'}:{path}"
    setup = tmp / "setup.sh"
    setup.write_text(f"export PATH={path}\nexport PYTHONWARNINGS=ignore\n")
    mrl = tmp / "megatron-rl"
    mrl.write_text(f'#!/bin/sh\nexec {sys.executable} {PROBE} "$@"\n')
    mrl.chmod(0o755)
    env = dict(
        os.environ,
        MRL_SETUP=str(setup),
        MRL=str(mrl),
        PROBE_OUT=str(tmp / "probe.json"),
        RAY_PORT=str(6380 + os.getpid() % 1000),
        **env,
    )
    out = _sh(
        f"sbatch --parsable --job-name={name} --nodes=1 --cpus-per-task=2 --open-mode=append "
        f"--output={tmp}/{name}-%j.out {ROOT}/slurm/bootstrap.sh",
        env=env,
        cwd=tmp,
    )
    return out.strip().split(";")[0]


def _exit_code(job: str) -> int:
    return int(re.search(r"ExitCode=(\d+):", _sh(f"scontrol show job {job}")).group(1))


def _state(job: str) -> tuple[str, int]:
    out = _sh(f"scontrol show job {job}")
    state = re.search(r"JobState=(\S+)", out).group(1)
    restarts = int(re.search(r"Restarts=(\d+)", out).group(1))
    return state, restarts


def _wait(job: str, done, timeout: float = 900) -> tuple[str, int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state, restarts = _state(job)
        if done(state, restarts):
            return state, restarts
        time.sleep(3)
    raise AssertionError(f"job {job} still {_state(job)} after {timeout} s")


def _rows(tmp: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()[1:]]


def _logs(tmp: Path, name: str) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp.glob(f"{name}-*.out")))


SMALL = " ".join(
    small_run("data.val_prompts=8", "eval.every_steps=100", "rollout.prompts_per_step=4", "checkpoint.every_steps=100")
)


@pytest.mark.slow
@pytest.mark.run
def test_sbatch_runs_the_recipe_to_completion_and_stops_only_its_own_processes(tmp_path, slurm):
    """A job runs the recipe to completion (every step logged, the last checkpointed), beside another user's Ray on
    the node, which survives the whole job (the bootstrap used to `ray stop --force`, which ends every Ray on the
    node); and a process named like a Slurm daemon survives the tooling's stop (it used to pkill by name), while the
    daemons the tooling started, munged included when it started it, are gone."""
    decoy = tmp_path / "slurmd"
    shutil.copy("/bin/sleep", decoy)
    bystander = subprocess.Popen([str(decoy), "900"])
    other_port = 7100 + os.getpid() % 800
    other_ray = subprocess.Popen(
        [str(VENV_BIN / "ray"), "start", "--head", f"--port={other_port}", "--num-cpus=1", "--block",
         "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        job = _submit(tmp_path, "done", f"total_steps=3 {SMALL}")
        state, _ = _wait(job, lambda s, r: s in ENDED)
        assert state == "COMPLETED", _logs(tmp_path, "done")[-4000:]
        steps = [r["step"] for r in _rows(tmp_path, "done") if "train/loss" in r]
        assert steps == [1, 2, 3]
        assert (tmp_path / "runs" / "done" / "checkpoints" / "latest").read_text() == "step_00000003"
        assert "Ray cluster up" in _logs(tmp_path, "done")
        time.sleep(5)
        assert other_ray.poll() is None, "the job's shutdown ended another Ray on the node"
        started = {d: (Path("/var/spool/megatron_rl_slurm") / f"{d}.pid").read_text().strip() for d in ("slurmd",)}
        subprocess.run(["bash", str(ROOT / "tools" / "slurm_localhost.sh"), "stop"], check=True, capture_output=True)
        assert bystander.poll() is None, "the tooling's stop ended a process it did not start"
        assert not Path(f"/proc/{started['slurmd']}").exists()
        assert not any(Path("/var/spool/megatron_rl_slurm").glob("*.pid"))
    finally:
        bystander.kill()
        os.killpg(other_ray.pid, signal.SIGTERM)
        other_ray.wait(timeout=60)
        subprocess.run(["bash", str(ROOT / "tools" / "slurm_localhost.sh"), "start"], capture_output=True)


@pytest.mark.slow
@pytest.mark.run
def test_pre_timeout_signal_checkpoints_requeues_and_resumes(tmp_path, slurm):
    job = _submit(tmp_path, "requeue", f"total_steps=400 {SMALL}")
    # wait until training steps are being logged, then send Slurm's pre-timeout signal to the batch shell
    deadline = time.time() + 600
    metrics = tmp_path / "runs" / "requeue" / "metrics.jsonl"
    while not (metrics.exists() and sum("train/loss" in line for line in metrics.read_text().splitlines()) >= 2):
        assert time.time() < deadline, _logs(tmp_path, "requeue")[-4000:]
        time.sleep(2)
    _sh(f"scancel --signal=USR1 --batch {job}")
    _wait(job, lambda s, r: r >= 1)  # the job requeued itself
    first = [r["step"] for r in _rows(tmp_path, "requeue") if "train/loss" in r]
    checkpoint = (tmp_path / "runs" / "requeue" / "checkpoints" / "latest").read_text()
    assert checkpoint == f"step_{first[-1]:08d}"  # checkpointed at the step it stopped
    # the requeued job resumes from that checkpoint at the next step
    while True:
        rows = [r["step"] for r in _rows(tmp_path, "requeue") if "train/loss" in r]
        if len(rows) > len(first):
            break
        assert time.time() < deadline + 600, _logs(tmp_path, "requeue")[-4000:]
        time.sleep(3)
    assert rows[len(first)] == first[-1] + 1
    assert "resumed from" in _logs(tmp_path, "requeue")
    # a user's scancel ends the job: the run checkpoints, and the bootstrap does not undo the cancel with a requeue
    _sh(f"scancel {job}")
    state, restarts = _wait(job, lambda s, r: s in ENDED, timeout=180)
    assert (state, restarts) == ("CANCELLED", 1)
    assert f"[bootstrap] job {job} was cancelled (scancel): not requeued" in _logs(tmp_path, "requeue")


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")


@pytest.mark.slow
def test_the_ray_node_gets_all_the_jobs_cpus(tmp_path, slurm):
    """A task on the job's Ray node may run on every CPU the job holds (srun does not pass sbatch's
    --cpus-per-task on to its steps, so a bound step's task had one core); the head listens on
    MRL_SOCKET_IFNAME's address; the run's exit code ends the job, named."""
    if os.cpu_count() < 2:
        pytest.skip("needs two CPUs to tell a bound step from the job")
    job = _submit_probe(tmp_path, "cpus", MRL_SOCKET_IFNAME="lo", PROBE_EXIT="3")
    state, _ = _wait(job, lambda s, r: s in ENDED, timeout=300)
    log = _logs(tmp_path, "cpus")
    report = json.loads((tmp_path / "probe.json").read_text())
    assert len(report["task_cpus"]) == 2, (report, log[-3000:])
    assert report["cluster_cpus"] == 2
    assert report["address"].startswith("127.0.0.1:")
    assert state == "FAILED" and _exit_code(job) == 3
    assert "[bootstrap] the run (megatron-rl train) failed (exit code 3)" in log, log[-3000:]


FAULTS = {  # a fault injected into one step: the job's last bootstrap line, and its exit code
    "ray-exits": ({"fake_ray": "exit 1"}, "the Ray head start on {host} failed (exit code 1)", 1),
    "ray-hangs": (
        {"fake_ray": "exec sleep 600", "RAY_START_TIMEOUT_S": "1"},
        "waiting for the Ray nodes failed (0 of 1 joined in 1 s)",
        1,
    ),
    "no-interface": (
        {"MRL_SOCKET_IFNAME": "mrl-none0"},
        "reading the address of MRL_SOCKET_IFNAME=mrl-none0 on {host} (ip addr) failed (exit code 1)",
        1,
    ),
    "check-refuses": ({"PROBE_CHECK_EXIT": "2"}, "the allocation check (megatron-rl check) failed (exit code 2)", 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_step_ends_the_job_naming_it(tmp_path, slurm, fault):
    env, message, code = FAULTS[fault]
    job = _submit_probe(tmp_path, fault, **env)
    state, _ = _wait(job, lambda s, r: s in ENDED, timeout=120)
    log = _logs(tmp_path, fault)
    lines = [line for line in log.splitlines() if line.startswith("[bootstrap]")]
    assert lines[-1] == "[bootstrap] " + message.format(host=_sh("hostname -s").strip()), log[-3000:]
    assert (state, _exit_code(job)) == ("FAILED", code)
    assert not (tmp_path / "probe.json").exists()  # the run never started


@pytest.mark.slow
def test_the_pre_timeout_signal_while_ray_starts_requeues_the_job(tmp_path, slurm):
    """USR1 before the run has started (the nodes' Ray still coming up) stops the start and requeues the job; it
    used to end the job, unrequeued (USR1's default action)."""
    job = _submit_probe(tmp_path, "early", "exec sleep 600", RAY_START_TIMEOUT_S="600")
    deadline = time.time() + 120
    while "[bootstrap] job" not in _logs(tmp_path, "early"):
        assert time.time() < deadline, _logs(tmp_path, "early")[-3000:]
        time.sleep(1)
    time.sleep(3)  # into the wait for the Ray nodes
    _sh(f"scancel --signal=USR1 --batch {job}")
    try:
        _wait(job, lambda s, r: r >= 1, timeout=120)
        log = _logs(tmp_path, "early")
        assert "[bootstrap] USR1 received before the run started: stopping" in log, log[-3000:]
        assert f"[bootstrap] requeueing job {job}" in log
    finally:
        _sh(f"scancel {job}")
        _wait(job, lambda s, r: s in ENDED, timeout=180)


@pytest.mark.parametrize("script", ["scalerl_moe.sh", "scalerl_dense.sh"])
def test_gpu_launch_scripts_match_their_recipe(script):
    text = (ROOT / "slurm" / script).read_text()
    header = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", text))
    model = re.search(r"MODEL=\$\{MODEL:-(\w+)\}", text).group(1)
    recipe = re.search(r"RECIPE=\$\{RECIPE:-([\w-]+)\}", text).group(1)
    run = load_config(recipe, model, [])
    gpus = int(header["nodes"]) * int(header["gpus-per-node"])
    needed = run.parallel.trainer_devices + run.rollout.engine.num_engines * run.rollout.engine.tp
    assert gpus == needed, f"{script}: {gpus} GPUs requested, the recipe uses {needed}"
    # One task per node, the bootstrap's steps, on whole nodes: each node's Ray step holds all its CPUs, at least
    # one per GPU (each trainer rank and engine takes a Ray CPU beside its GPU).
    assert header["ntasks-per-node"] == "1" and "#SBATCH --exclusive" in text
    assert int(header["cpus-per-task"]) >= int(header["gpus-per-node"])
    assert "requeue" in text and "--signal=B:USR1@" in text


def test_bootstrap_passes_only_existing_options():
    text = (ROOT / "slurm" / "bootstrap.sh").read_text()
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse has no public API)
    for line in re.findall(r'"\$MRL" ([\w-]+) ([^\n]*)', text):
        sub, rest = line
        assert sub in subcommands
        options = {tok for tok in shlex.split(rest.replace('"', "")) if tok.startswith("--")}
        known = {opt for action in subcommands[sub]._actions for opt in action.option_strings}  # noqa: SLF001
        assert options <= known, f"{sub}: unknown options {options - known}"
