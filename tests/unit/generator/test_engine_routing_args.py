"""Engine arguments under MoE routing replay: every answer carries its routing record, and on GPUs the MoE runner is
one that captures it (SGLang's `auto` may pick flashinfer_trtllm, which leaves every record 0)."""

from __future__ import annotations

from megatron_rl.config import load_config
from megatron_rl.orchestration.engines import with_routing


def _engine(*overrides: str):
    return with_routing(load_config("scalerl", "qwen3_30b_a3b", ["algo.routing_replay=rollout", *overrides]))


def test_replay_on_gpus_pins_a_capturing_moe_runner():
    assert _engine().extra_args == ["--enable-return-routed-experts", "--moe-runner-backend", "triton"]


def test_a_runner_the_user_names_is_kept():
    args = _engine("rollout.engine.extra_args=[--moe-runner-backend=deep_gemm]").extra_args
    assert args == ["--moe-runner-backend=deep_gemm", "--enable-return-routed-experts"]


def test_cpu_engines_and_runs_without_replay_are_left_as_they_are():
    assert _engine("rollout.engine.device=cpu").extra_args == ["--enable-return-routed-experts"]
    plain = with_routing(load_config("scalerl", "qwen3_30b_a3b"))
    assert "--enable-return-routed-experts" not in plain.extra_args and "--moe-runner-backend" not in plain.extra_args
