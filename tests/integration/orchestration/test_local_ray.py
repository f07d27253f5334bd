"""The local Ray head a one-machine run starts (`orchestration.ray_head.start_ray`): no autoscaler monitor (one
machine has no nodes to add), no API server (no jobs, state API or dashboard) and the stand-in in place of the
dashboard agent, everything else Ray starts for a run still there."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import glob, json, os, sys, time, psutil, ray
from megatron_rl.config import load_config
from megatron_rl.orchestration.ray_head import start_ray
import ray._private.node as node
import ray._private.parameter as parameter
import ray._private.utils as utils
base, api, deps = parameter.RayParams, node.Node.start_api_server, utils.get_dashboard_dependency_error
start_ray(load_config("scalerl-cpu", None, []))
try:
    children = psutil.Process().children(recursive=True)
    commands = [" ".join(p.cmdline()) for p in children]
    stand_ins = [p for p in children if any(arg.endswith("ray_agent_stand_in.py") for arg in p.cmdline())]
    session = ray._private.worker._global_node.get_session_dir_path()
    ports = {os.path.basename(f).rsplit("_", 1)[0]: open(f).read().strip() for f in glob.glob(session + "/*_port_*")}
    print(json.dumps({
        "commands": commands,
        "cpus": ray.cluster_resources().get("CPU"),
        "answer": ray.get(ray.remote(lambda: 41 + 1).remote()),
        "runtime_env": ray.get(ray.remote(lambda: os.environ.get("PROBE")).options(
            runtime_env={"env_vars": {"PROBE": "set"}}).remote(), timeout=60),
        "stand_in_private_mib": [p.memory_full_info().uss / 2**20 for p in stand_ins],
        "ports": ports,
        "dashboard_deps_imported": "ray.dashboard.optional_deps" in sys.modules,
        "restored": parameter.RayParams is base and node.Node.start_api_server is api
        and utils.get_dashboard_dependency_error is deps,
    }))
finally:
    ray.shutdown()
deadline = time.monotonic() + 10
alive = lambda p: p.is_running() and p.status() != psutil.STATUS_ZOMBIE
while any(alive(p) for p in stand_ins) and time.monotonic() < deadline:
    time.sleep(0.2)
print(json.dumps({"stand_in_left": [p.pid for p in stand_ins if alive(p)]}))
"""


def test_the_local_head_starts_without_the_autoscaler_monitor_api_server_or_dashboard_agent() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    *_, line, after = result.stdout.strip().splitlines()
    got = json.loads(line)
    commands = got["commands"]
    assert not any("autoscaler/_private/monitor.py" in c for c in commands), commands
    assert not any("dashboard/dashboard.py" in c for c in commands), commands
    assert not any("dashboard/agent.py" in c or "DashboardAgent" in c for c in commands), commands
    for part in ("gcs_server", "raylet", "log_monitor.py", "RuntimeEnvAgent"):  # the log monitor prints actors' output
        assert any(part in c for c in commands), (part, commands)
    assert got["answer"] == 42 and got["cpus"] >= 1
    # the stand-in wrote -1 ("not in use") where the dashboard agent's servers would be; the runtime-env agent is
    # Ray's, on a port, and builds an actor's environment
    dashboard_ports = ("metrics_agent_port", "metrics_export_port", "dashboard_agent_listen_port")
    assert [got["ports"][name] for name in dashboard_ports] == ["-1"] * 3, got["ports"]
    assert int(got["ports"]["runtime_env_agent_port"]) > 0 and got["runtime_env"] == "set", got
    assert len(got["stand_in_private_mib"]) == 1 and got["stand_in_private_mib"][0] < 16, got
    assert json.loads(after) == {"stand_in_left": []}  # it ends with the raylet
    assert not got["dashboard_deps_imported"]
    assert got["restored"], "ray's RayParams, Node.start_api_server or get_dashboard_dependency_error left replaced"


LATE_RAYLET = """
import json, psutil, ray
import ray._private.node as node
from megatron_rl.config import load_config
from megatron_rl.orchestration.ray_head import start_ray
first, real_init = [], node.Node.__init__
def late(self, *args, **kwargs):  # the first head starts, then its raylet is reported late, as on a loaded machine
    real_init(self, *args, **kwargs)
    if not first:
        first.append(self.all_processes["gcs_server"][0].process.pid)
        raise Exception("The current node timed out during startup. This could happen because ...")
node.Node.__init__ = late
start_ray(load_config("scalerl-cpu", None, []))
try:
    print(json.dumps({"answer": ray.get(ray.remote(lambda: 41 + 1).remote()), "first_gcs_alive": psutil.pid_exists(
        first[0]) and psutil.Process(first[0]).status() != psutil.STATUS_ZOMBIE}))
finally:
    ray.shutdown()
"""


def test_a_raylet_late_to_register_ends_the_half_started_head_and_starts_once_more() -> None:
    result = subprocess.run([sys.executable, "-c", LATE_RAYLET], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ray: the local head's raylet did not register within Ray's 30 s (ended " in result.stdout
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == {"answer": 42, "first_gcs_alive": False}
