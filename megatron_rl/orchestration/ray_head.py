"""How a run starts or joins Ray: `megatron-rl train` and `megatron-rl eval` alike.

Inside a cluster allocation (RAY_ADDRESS, set by the Slurm script) the allocation's Ray is joined as it is; off a
cluster a fresh local head is started with only the processes a one-machine run uses, and a run that handles SIGTERM
itself keeps its handler while Ray starts.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import ray

from megatron_rl.config import RunConfig
from megatron_rl.orchestration.placement import cpu_processes, local_ray_cpus


def start_ray(run: RunConfig, keep_sigterm: bool | None = None) -> None:
    """Join the allocation's Ray (RAY_ADDRESS, set by the Slurm script) or start a fresh local instance. The
    driver's SIGTERM handler survives Ray's start when `keep_sigterm` (default: the run checkpoints on a signal)."""
    keep = run.checkpoint.save_on_signal if keep_sigterm is None else keep_sigterm
    if ray.is_initialized():
        return
    # Off a cluster, always a fresh local instance ("local"): address=None would join any Ray head already
    # running on this machine (another run's, another user's) and fail on its auth token.
    if os.environ.get("RAY_ADDRESS"):
        with _keeping_sigterm(keep):
            ray.init(address="auto", include_dashboard=False)
    else:
        cores = os.cpu_count() or 1
        slots, processes = local_ray_cpus(run, cores), cpu_processes(run)
        if processes > cores:
            print(f"ray: {processes} processes on {cores} cores (trainer ranks and CPU engines share them)", flush=True)
        with _one_machine_head(), _keeping_sigterm(keep):
            try:
                ray.init(address="local", include_dashboard=False, num_cpus=slots)
            except Exception as exc:
                if RAYLET_TIMEOUT not in str(exc):
                    raise
                print(f"ray: the local head's raylet did not register within Ray's 30 s ({_end_head()}); once more")
                ray.init(address="local", include_dashboard=False, num_cpus=slots)


RAYLET_TIMEOUT = "timed out during startup"
"""Ray's error when its raylet has not registered with the GCS within 30 s of the head's start (a limit hardcoded in
ray/_private/node.py): on a loaded machine (a 2-core laptop building a model, CI running two test files) the raylet
can be late. The half-started head is ended and started once more; a second timeout is the run's error."""


def _end_head() -> str:
    """End the processes a failed `ray.init` left running (its GCS, raylet, log monitor and agents: the driver's
    children run from Ray's package), say which."""
    import psutil

    package = os.path.dirname(ray.__file__) + os.sep
    ended = []
    for child in psutil.Process().children(recursive=True):
        try:
            if any(part.startswith(package) for part in child.cmdline()):
                child.kill()
                ended.append(child)
        except psutil.Error:
            continue
    psutil.wait_procs(ended, timeout=10)
    with contextlib.suppress(Exception):
        ray.shutdown()
    return f"ended {len(ended)} of its processes"


@contextlib.contextmanager
def _keeping_sigterm(keep: bool) -> Any:
    """`ray.init` first replaces the driver's SIGTERM handler with `sys.exit(15)`, raised wherever the driver is:
    in the middle of Ray's own start, it leaves a half-started head to the reaper and the process to die in
    interpreter shutdown. A run that handles SIGTERM itself (StopFlag) keeps its handler while Ray starts."""
    if not keep:
        yield
        return
    import ray._private.utils as utils

    set_handler = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = set_handler


@contextlib.contextmanager
def _one_machine_head() -> Any:
    """A local Ray head without the processes a one-machine run never uses: the autoscaler's monitor (one
    machine's Ray has no nodes to add or remove; 55 MB of memory), the API server (`dashboard.py`, behind Ray's
    jobs, state API and dashboard, none of which a run calls; ~1 s of CPU on the start-up's busy cores and ~100 MB)
    and the dashboard agent, whose every module serves only those (`ray_agent_stand_in.py` takes its place: ~3 MiB
    of private memory where the agent held ~77). `ray.init` exposes no switch for any of them: `ray start --head` has
    one for the monitor (`--no-monitor`, the field `RayParams.no_monitor` it sets), which the head `ray.init` starts
    is given; the node's `start_api_server` does nothing while it starts; the raylet's command names the stand-in as
    its dashboard agent. `ray.init` would also import the dashboard's optional dependencies (aiohttp, grpc,
    prometheus, opencensus; ~0.25 CPU-s, and Ray's start 0.5 s later, measured alternating) to decide how to start
    the agent; it is told they are absent. Ray's log monitor (actors' output on this console), GCS, raylet and
    runtime-env agent still start; a head started by `ray start` (a Slurm allocation) is joined as it is."""
    import ray._private.node as node
    import ray._private.parameter as parameter
    import ray._private.services as services
    import ray._private.utils as utils

    base, start_api_server = parameter.RayParams, node.Node.start_api_server
    dependency_error, start_process = utils.get_dashboard_dependency_error, services.start_ray_process

    class HeadParams(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.no_monitor = True

    parameter.RayParams = HeadParams
    node.Node.start_api_server = lambda self, **kwargs: None
    utils.get_dashboard_dependency_error = lambda: ImportError("a one-machine run starts no dashboard")

    def start_ray_process(command: list[str], process_type: str, *args: Any, **kwargs: Any) -> Any:
        if process_type == services.ray_constants.PROCESS_TYPE_RAYLET:
            command = [_stand_in_agent(part) if part.startswith(DASHBOARD_AGENT) else part for part in command]
        return start_process(command, process_type, *args, **kwargs)

    services.start_ray_process = start_ray_process
    try:
        yield
    finally:
        parameter.RayParams, node.Node.start_api_server = base, start_api_server
        utils.get_dashboard_dependency_error, services.start_ray_process = dependency_error, start_process


DASHBOARD_AGENT = "--dashboard_agent_command="
STAND_IN = Path(__file__).with_name("ray_agent_stand_in.py")


def _stand_in_agent(flag: str) -> str:
    """The raylet's `--dashboard_agent_command=<command line>` flag with the stand-in as the command, given the real
    agent's node id and session directory (the raylet splits the line as a shell would)."""
    agent = shlex.split(flag[len(DASHBOARD_AGENT) :])
    kept = [arg for arg in agent if arg.startswith(("--node-id=", "--session-dir="))]
    if len(kept) != 2:
        raise RuntimeError(f"ray: the dashboard agent's command has no --node-id or --session-dir: {agent}")
    return DASHBOARD_AGENT + subprocess.list2cmdline([sys.executable, "-S", "-I", str(STAND_IN), *kept])
