"""Stands in for `megatron-rl` in slurm/bootstrap.sh (its MRL) where a test needs the job's Ray cluster, not a run.

    MRL=<a script running `python tests/integration/orchestration/slurm_probe.py "$@"`> sbatch slurm/bootstrap.sh

`check` exits with $PROBE_CHECK_EXIT (default 0) and `node-check` with 0. `train` joins the cluster the
bootstrap started (RAY_ADDRESS), as the run would, and writes to $PROBE_OUT (JSON) what that cluster gives: the
CPUs a Ray task may run on (its affinity, inherited from the srun step that started the node's Ray), the cluster's
CPU count and its address; then exits with $PROBE_EXIT (default 0).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if argv[0] == "check":
        return int(os.environ.get("PROBE_CHECK_EXIT", "0"))
    if argv[0] != "train":
        return 0
    import ray

    ray.init(address="auto", logging_level="ERROR")

    @ray.remote(num_cpus=1)
    def affinity() -> list[int]:
        return sorted(os.sched_getaffinity(0))

    report = {
        "task_cpus": ray.get(affinity.remote()),
        "cluster_cpus": ray.cluster_resources().get("CPU", 0.0),
        "address": os.environ["RAY_ADDRESS"],
    }
    ray.shutdown()
    Path(os.environ["PROBE_OUT"]).write_text(json.dumps(report))
    return int(os.environ.get("PROBE_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
