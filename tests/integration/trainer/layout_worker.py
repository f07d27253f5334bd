"""Form megatron-core's process groups for layouts at their full world size, one rank at a time, in this process.

    python tests/integration/trainer/layout_worker.py JOBS_JSON OUT

JOBS: [{"tp", "pp", "cp" (optional), "ep", "etp", "world", "ranks": [...]}, ...]. torch's fake backend lets this
process be rank r of a W-rank job, so `parallel_state.initialize_model_parallel` forms the groups a cluster would
(and raises the errors a cluster would). OUT (torch.save): per job, {"error": str} or {"ranks": {r: group info}}
with each group's size and member ranks.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def _groups(ps) -> dict:
    def ranks(group) -> list[int]:
        return dist.get_process_group_ranks(group)

    return {
        "tp": ranks(ps.get_tensor_model_parallel_group()),
        "pp": ranks(ps.get_pipeline_model_parallel_group()),
        "cp": ranks(ps.get_context_parallel_group()),
        "dp": ranks(ps.get_data_parallel_group()),
        "ep": ranks(ps.get_expert_model_parallel_group()),
        "etp": ranks(ps.get_expert_tensor_parallel_group()),
        "edp": ranks(ps.get_expert_data_parallel_group()),
    }


def run_job(job: dict) -> dict:
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    result: dict = {"ranks": {}}
    for rank in job["ranks"]:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=job["world"])
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=job["tp"],
                pipeline_model_parallel_size=job["pp"],
                context_parallel_size=job.get("cp", 1),
                expert_model_parallel_size=job["ep"],
                expert_tensor_parallel_size=job["etp"],
                create_gloo_process_groups=False,
            )
            result["ranks"][rank] = _groups(ps)
        except (RuntimeError, ValueError, AssertionError) as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    return result


if __name__ == "__main__":
    jobs = json.loads(sys.argv[1])
    torch.save([run_job(job) for job in jobs], sys.argv[2])
