"""The run: one `RunConfig` of all sections, with the checks that span sections; logging, checkpoints, compute."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from megatron_rl.config.algo import AlgoConfig
from megatron_rl.config.data import DataConfig, RewardsConfig
from megatron_rl.config.errors import fail
from megatron_rl.config.evaluation import EvalConfig
from megatron_rl.config.model import ModelConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.trainer import GPU_IMAGE_HAS_APEX, ParallelConfig, TrainerConfig, check_norm_recompute


@dataclass
class LoggingConfig:
    wandb: Literal["online", "offline", "disabled"] = "offline"
    project: str = "megatron_rl"
    console_every_steps: int = 1
    live_scaling_fit: bool = True
    """Fit the scaling curve at each validation and log the predicted asymptote (per task too)."""
    scaling_fit_start: float = 0.0
    """Warm-up cut for the live and final fits, in device-hours: earlier points are not fitted (paper: 1,500
    GPU-hours)."""


@dataclass
class CheckpointConfig:
    every_steps: int = 100
    keep_last: int = 2
    resume: Literal["auto", "never"] = "auto"
    """auto = continue from the newest checkpoint in the run directory if there is one (the same experiment: a
    changed config is applied or refused field by field, orchestration/resume.py)."""
    fork_from: str | None = None
    """A run directory (or one of its checkpoints) whose latest weights this new run starts from, with a fresh
    optimizer, data order and step count (`megatron-rl train --fork RUN`); the model must be the same, anything
    else may differ. Once this run has checkpoints of its own, a restart resumes them."""
    save_on_signal: bool = True
    """Checkpoint and exit cleanly on SIGTERM / SIGUSR1 (Slurm's pre-timeout signal)."""

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            fail("every_steps", f"must be >= 1, got {self.every_steps}")
        if self.keep_last < 1:
            fail("keep_last", f"must be >= 1 (a run resumes from its newest checkpoint), got {self.keep_last}")


@dataclass
class ComputeConfig:
    """What counts as one device for the scaling law's x-axis (device-hours)."""

    device_kind: Literal["gpu", "cpu_core"] = "gpu"
    generator_devices: int | None = None
    """Devices the generators use; null = engine.num_engines * engine.tp."""
    device_memory_gib: float = 79.6
    """Usable memory of one GPU in GiB, for the memory plan (`megatron-rl plan`): H100 80GB reports 81,559 MiB."""
    host_memory_gib: float = 1800.0
    """Host memory of one node in GiB that its trainer ranks may use (a DGX H100 has 2 TB), for the plan's check of
    offloaded optimizer state and routing records (ranks per node: the allocation's GPUs per node, 8 without one)."""


@dataclass
class RunConfig:
    """A whole run: one recipe, one model, and the overrides given on the command line."""

    name: str = "scalerl"
    recipe: str = "scalerl"
    output_dir: str = "runs"
    """Run directory parent; the run writes to <output_dir>/<name>/."""
    seed: int = 1234
    total_steps: int = 10000
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)

    def __post_init__(self) -> None:
        # Cross-section checks: each names the field to change.
        if self.total_steps < 1:
            fail("total_steps", f"must be >= 1, got {self.total_steps}")
        d = self.data
        if not any(d.val_prompts if s.val_prompts is None else s.val_prompts for s in d.datasets):
            fail(
                "data.val_prompts",
                "no dataset holds out validation prompts: a run's validation (R0 and every point of the scaling "
                "curve) needs at least one",
            )
        if not self.name or self.name in (".", "..") or Path(self.name).name != self.name or "\\" in self.name:
            fail("name", f"must be one directory name inside output_dir (no '/' or '..'), got {self.name!r}")
        for i, source in enumerate(d.datasets):
            unknown = [name for name in source.tools if name not in self.rollout.tools.enabled]
            if unknown:
                fail(
                    f"data.datasets[{i}].tools",
                    f"{unknown} not in rollout.tools.enabled={self.rollout.tools.enabled} (the tools the run offers)",
                )
        if self.rollout.interruption.enabled and self.algo.length_penalty.enabled:
            fail(
                "algo.length_penalty.enabled",
                "length penalty and rollout.interruption are alternatives (loo-lp); enable only one",
            )
        p, m = self.parallel, self.model
        if m.num_attention_heads % p.tp or m.num_query_groups % p.tp:
            fail(
                "parallel.tp",
                f"must divide the attention heads ({m.num_attention_heads}) and query groups "
                f"({m.num_query_groups}), got {p.tp}",
            )
        if m.ffn_hidden_size % p.tp:
            fail("parallel.tp", f"must divide model.ffn_hidden_size={m.ffn_hidden_size}, got {p.tp}")
        if m.num_layers % p.pp:
            fail("parallel.pp", f"must divide model.num_layers={m.num_layers}, got {p.pp}")
        if p.cp > 1 and self.compute.device_kind == "gpu" and self.trainer.layer_spec == "local":
            fail(
                "parallel.cp",
                f"{p.cp} with trainer.layer_spec=local on GPUs: context parallelism there is Transformer Engine's "
                "attention (its ring exchange); the local spec's attention all-gathers every layer's keys and values "
                "over the CP group and keeps the whole row's for the backward (the CPU path), which is not what the "
                "plan counts. Use trainer.layer_spec=auto or transformer_engine",
            )
        if self.trainer.optimizer.cpu_offload and not p.distributed_optimizer:
            fail(
                "trainer.optimizer.cpu_offload",
                "megatron-core offloads the optimizer state of its distributed optimizer only; set "
                "parallel.distributed_optimizer=true",
            )
        if self.algo.routing_replay != "none" and not m.is_moe:
            fail("algo.routing_replay", f"routing replay needs an MoE model; {m.name} is dense (set it to none)")
        if p.ep > 1 and not m.is_moe:
            fail("parallel.ep", f"expert parallel needs an MoE model; {m.name} is dense")
        if p.etp is not None and not m.is_moe and p.etp != p.tp:
            fail("parallel.etp", f"expert tensor parallel applies to MoE models; {m.name} is dense (leave it null)")
        if m.is_moe:
            assert m.moe.num_experts is not None
            etp = p.expert_tp(True)
            if m.moe.num_experts % p.ep:
                fail("parallel.ep", f"must divide model.moe.num_experts={m.moe.num_experts}, got {p.ep}")
            expert_ranks = etp * p.ep * p.pp
            if p.trainer_devices % expert_ranks:
                fail(
                    "parallel.etp" if p.etp is not None else "parallel.ep",
                    "megatron-core forms expert layers as world = etp x ep x pp x expert-dp: world size "
                    f"{p.trainer_devices} is not a multiple of etp x ep x pp = {etp} x {p.ep} x {p.pp} "
                    f"= {expert_ranks}",
                )
            expert_ffn = m.moe.ffn_hidden_size or m.ffn_hidden_size
            if expert_ffn % etp:
                fail("parallel.etp", f"must divide the expert ffn hidden size {expert_ffn}, got {etp}")
            if p.tp > 1 and not p.sequence_parallel:
                fail("parallel.sequence_parallel", "megatron-core requires sequence parallel for MoE with tp > 1")
        self.check_recompute()
        self.check_kernels()
        self.check_row_budget(phrase_tokens=0)

    def check_engine_attention(self) -> None:
        """The engines can serve the model's attention: SGLang's CPU engine (torch-native attention) has no chunked
        local attention, so a Llama-4 whose chunk is shorter than the rollout's longest sequence would be served with
        full attention (the trainer alone, as in tests, runs it on CPU: this is checked where engines start)."""
        chunk = self.model.attention_chunk_size
        if self.rollout.engine.device == "cpu" and chunk is not None and chunk < self.rollout.context_length:
            fail(
                "model.attention_chunk_size",
                f"{chunk} is shorter than rollout.context_length={self.rollout.context_length}, and SGLang's CPU "
                "engine (torch-native attention) has no chunked local attention: it would serve longer sequences "
                "with full attention. Lower the rollout's length budgets to the chunk or serve on GPUs",
            )

    def check_starting_model(self) -> None:
        """A GPU run starts RL from a pretrained checkpoint (`model.hf_path`); only a CPU run builds its tiny model
        itself. Checked by `check` (the Slurm bootstrap runs it before Ray starts) and by `train`, not when a config
        is loaded: plans and config checks of a GPU layout need no checkpoint."""
        if self.compute.device_kind == "gpu" and not self.model.hf_path:
            fail(
                "model.hf_path",
                f"a GPU run starts RL from a pretrained Hugging Face checkpoint of {self.model.name}; set "
                "model.hf_path=/path/to/checkpoint (Slurm: MODEL_PATH=/path/to/checkpoint sbatch slurm/...)",
            )
        if self.model.hf_path:
            self.check_context(Path(self.model.hf_path))

    def check_context(self, hf_dir: Path) -> None:
        """The engines load `hf_dir` and refuse a --context-length beyond its config.json's positions: the
        rollout's longest sequence (`rollout.context_length`) must fit them."""
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            fail("model.hf_path", f"{hf_dir} has no config.json (not a Hugging Face checkpoint directory)")
        hf = json.loads(path.read_text())
        positions = hf.get("max_position_embeddings") or (hf.get("text_config") or {}).get("max_position_embeddings")
        if positions and self.rollout.context_length > positions:
            fail(
                "rollout.context_length",
                f"prompt + thinking + answer budgets and the interruption phrase ({self.rollout.context_length} "
                f"tokens) exceed the {positions} positions of {path} (max_position_embeddings): the engines refuse "
                "such a context; lower rollout.max_prompt_tokens, rollout.interruption.max_thinking_tokens or "
                "rollout.answer_tokens",
            )

    def check_kernels(self) -> None:
        """A fused kernel forced on where the run's nodes do not have it stops here, not at model build."""
        if self.trainer.performance.gradient_accumulation_fusion and not (
            self.trainer_uses_transformer_engine and GPU_IMAGE_HAS_APEX
        ):
            where = (
                "the GPU image does not build Apex" if self.compute.device_kind == "gpu" else "a CPU run has no CUDA"
            )
            fail(
                "trainer.performance.gradient_accumulation_fusion",
                "true needs Transformer Engine and NVIDIA Apex's fused_weight_gradient_mlp_cuda kernel (megatron-core's"
                f" output layer refuses to build without it); {where}. Leave it null (on where the kernel is) or false",
            )

    @property
    def trainer_uses_transformer_engine(self) -> bool:
        """Whether the trainer builds with Transformer Engine's layer spec where it runs: a GPU run (the GPU
        image installs TE) whose `trainer.layer_spec` is not local; never on a CPU run."""
        return self.compute.device_kind == "gpu" and self.trainer.layer_spec != "local"

    def check_recompute(self) -> None:
        """megatron-core 0.19.2's rules for selective recompute, for the layer spec the trainer will use: norms
        only with Transformer Engine (`check_norm_recompute`); `moe_act` only with `moe_grouped_gemm`
        (TransformerConfig.__post_init__), which is off for a dense model and, when
        `trainer.performance.moe_grouped_gemm` is null, on only where the trainer runs Transformer Engine."""
        rc, t = self.trainer.recompute, self.trainer
        check_norm_recompute(rc, self.trainer_uses_transformer_engine)
        if rc.granularity != "selective" or "moe_act" not in rc.modules:
            return
        setting = t.performance.moe_grouped_gemm
        if not self.model.is_moe:
            why = f"model {self.model.name} is dense (grouped GEMM is an MoE setting, off without experts)"
        elif setting is False:
            why = "trainer.performance.moe_grouped_gemm=false"
        elif setting is None and (t.layer_spec == "local" or self.compute.device_kind != "gpu"):
            where = "trainer.layer_spec=local" if t.layer_spec == "local" else "a CPU run (compute.device_kind)"
            why = f"trainer.performance.moe_grouped_gemm=null resolves to off with {where}"
        else:
            return
        fail(
            "trainer.recompute.modules",
            f"{rc.modules} has 'moe_act', which megatron-core recomputes only with grouped GEMM experts "
            f"(moe_grouped_gemm); {why}. Drop moe_act or recompute 'moe' instead",
        )

    def check_row_budget(self, phrase_tokens: int) -> None:
        """The longest sequence a rollout can make, padded for sequence parallel, must fit one micro-batch row:
        max_prompt_tokens + max_thinking_tokens + the interruption phrase + answer_tokens, and with tools the
        trajectory's tool responses (rollout.tools.max_environment_tokens). The config check counts the phrase as 0
        tokens; the driver checks again with the tokenizer's count."""
        r, p = self.rollout, self.parallel
        longest = r.max_prompt_tokens + r.interruption.max_thinking_tokens + r.answer_tokens + r.environment_tokens
        longest += phrase_tokens if r.interruption.enabled else 0
        padded = p.padded_row([longest])
        if self.trainer.micro_batch_tokens < padded:
            phrase = f" + {phrase_tokens} phrase tokens" if phrase_tokens else ""
            tools = " + rollout.tools.max_environment_tokens" if r.environment_tokens else ""
            rule = f"a multiple of {p.pad_multiple}"
            if p.cp > 1:
                rule = f"2 x cp = {p.seq_pad_multiple} chunks per sequence (parallel.cp={p.cp}), rows {rule}"
            fail(
                "trainer.micro_batch_tokens",
                f"{self.trainer.micro_batch_tokens} cannot hold the longest sequence a rollout makes: "
                f"max_prompt_tokens + max_thinking_tokens + answer_tokens{tools}{phrase} = {longest} tokens "
                f"({padded} padded to {rule})" + ("" if phrase_tokens else ", plus the interruption phrase"),
            )

    @property
    def collective_timeout_s(self) -> float:
        """How long a trainer collective waits before NCCL's watchdog ends the rank: while rank 0 pushes a bucket
        to the engines (up to `rollout.sync_timeout_s`, then a restart and a second push) the other ranks wait in
        the next gather. torch's default (10 min) is shorter than a push with a large sync timeout; this is twice
        the push's worst case plus 10 min, and never less than megatron-core's own default of 30 min."""
        return max(1800.0, 2 * 2 * self.rollout.sync_timeout_s + 600.0)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name
