"""The local Ray head a one-machine run starts (`orchestration.train.start_ray`): no autoscaler monitor (one
machine has no nodes to add) and no API server (no jobs, state API or dashboard), everything else Ray starts for a
run still there."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, psutil, ray
from megatron_rl.config import load_config
from megatron_rl.orchestration.train import start_ray
import ray._private.node as node
import ray._private.parameter as parameter
base, api = parameter.RayParams, node.Node.start_api_server
start_ray(load_config("scalerl-cpu", None, []))
try:
    commands = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    print(json.dumps({
        "commands": commands,
        "cpus": ray.cluster_resources().get("CPU"),
        "answer": ray.get(ray.remote(lambda: 41 + 1).remote()),
        "restored": parameter.RayParams is base and node.Node.start_api_server is api,
    }))
finally:
    ray.shutdown()
"""


def test_the_local_head_starts_without_the_autoscaler_monitor_and_api_server() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    commands = got["commands"]
    assert not any("autoscaler/_private/monitor.py" in c for c in commands), commands
    assert not any("dashboard/dashboard.py" in c for c in commands), commands
    for part in ("gcs_server", "raylet", "log_monitor.py"):  # the log monitor prints the actors' output here
        assert any(part in c for c in commands), (part, commands)
    assert got["answer"] == 42 and got["cpus"] >= 1
    assert got["restored"], "ray's RayParams or Node.start_api_server was left replaced"
