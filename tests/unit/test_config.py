"""Config loading, overrides, validation messages, and the no-heavy-imports rule."""

import dataclasses

import pytest

from megatron_rl.config import (
    AlgoConfig,
    ConfigError,
    RunConfig,
    apply_overrides,
    build,
    load_config,
    load_resolved,
    save_config,
)


def test_defaults_are_the_paper_recipe():
    c = RunConfig()
    assert (c.algo.loss, c.algo.eps_max, c.algo.aggregation, c.algo.advantage_norm) == ("cispo", 5.0, "prompt", "batch")
    assert c.algo.zero_variance_filter and c.algo.no_positive_resampling == 0.9
    assert (c.rollout.mode, c.rollout.k) == ("pipeline", 8)
    assert c.rollout.prompts_per_step * c.rollout.generations_per_prompt == 768
    assert c.rollout.interruption.max_thinking_tokens == 12288 and c.rollout.answer_tokens == 2048
    assert c.trainer.optimizer.lr == 5e-7 and c.trainer.optimizer.adam_eps == 1e-15
    assert c.trainer.optimizer.warmup_steps == 100 and c.trainer.optimizer.weight_decay == 0.01
    assert c.trainer.fp32_lm_head and c.rollout.engine.fp32_lm_head


@pytest.mark.parametrize(("loss", "low", "high"), [("gspo", 3e-3, 5e-3), ("dapo", 0.2, 0.28), ("grpo", 0.2, 0.2)])
def test_clip_epsilons_default_per_loss(loss, low, high):
    cfg = AlgoConfig(loss=loss)
    assert (cfg.eps_low, cfg.eps_high) == (low, high)
    assert AlgoConfig(loss=loss, eps_low=0.1).eps_low == 0.1


def test_overrides_are_typed_and_dotted():
    c = load_config(
        "scalerl",
        "tiny_dense",
        [
            "trainer.optimizer.lr=1e-6",
            "rollout.k=4",
            "algo.loss=gspo",
            "algo.no_positive_resampling=null",
            "trainer.fp32_lm_head=false",
        ],
    )
    assert c.trainer.optimizer.lr == 1e-6 and isinstance(c.trainer.optimizer.lr, float)
    assert c.rollout.k == 4 and c.algo.loss == "gspo" and c.algo.no_positive_resampling is None
    assert c.trainer.fp32_lm_head is False


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algo.loss=foo", "algo.loss: 'foo' is not one of ['cispo', 'gspo', 'dapo', 'grpo']"),
        ("algo.aggregation=mean", "algo.aggregation: 'mean' is not one of ['prompt', 'sample', 'token']"),
        ("rollout.k=0", "rollout.k: must be >= 1"),
        ("rollout.k=two", "rollout.k: expected an integer"),
        ("rollout.generations_per_prompt=1", "rollout.generations_per_prompt: must be >= 2"),
        ("algo.eps_max=0.5", "algo.eps_max: must be > 1"),
        ("rollout.bogus=1", "rollout.bogus: unknown field of RolloutConfig"),
        ("trainer.optimizer.lr=-1", "trainer.optimizer.lr: must be > 0"),
        ("parallel.tp=3", "parallel.trainer_devices: world size 1 must be a multiple of tp x pp = 3 x 1"),
        ("parallel.sequence_parallel=true", "parallel.sequence_parallel: needs tp > 1"),
        ("parallel.etp=0", "parallel.etp: must be >= 1 or null"),
        ("model.attention_chunk_size=0", "model.attention_chunk_size: must be a positive number of tokens or null"),
        ("model.floor_scale=0", "model.floor_scale: must be >= 1"),
        ("trainer.recompute.granularity=some", "trainer.recompute.granularity: 'some' is not one of"),
        ("trainer.recompute.modules=[attn]", "trainer.recompute.modules: ['attn'] not among megatron-core's"),
        ("trainer.recompute={granularity: selective, modules: []}", "trainer.recompute.modules: selective recompute"),
        ("trainer.recompute.num_layers=0", "trainer.recompute.num_layers: must be >= 1"),
        (
            "trainer.micro_batch_tokens=16000",
            "trainer.micro_batch_tokens: 16000 cannot hold the longest sequence a rollout makes: max_prompt_tokens "
            "+ max_thinking_tokens + answer_tokens = 16384 tokens",
        ),
        ("algo.length_penalty.enabled=true", "algo.length_penalty.enabled: length penalty and rollout.interruption"),
        ("data.datasets=[{source: x, task: poetry}]", "data.datasets[0].task: 'poetry' is not one of"),
        ("data.datasets=[{source: x, tools: [python]}]", "data.datasets[0].tools: ['python'] not in rollout.tools"),
        ("rollout.tools.max_calls=0", "rollout.tools.max_calls: must be >= 1"),
        (
            "rollout.tools.enabled=[python]",
            "trainer.micro_batch_tokens: 16512 cannot hold the longest sequence a rollout makes: max_prompt_tokens "
            "+ max_thinking_tokens + answer_tokens + rollout.tools.max_environment_tokens = 17408 tokens",
        ),
        ("noequals", "expected the form section.field=value"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as info:
        load_config("scalerl", "tiny_dense", [override])
    assert message in str(info.value)


def test_parallel_layout_checked_against_the_model():
    with pytest.raises(ConfigError, match="parallel.ep: expert parallel needs an MoE model"):
        load_config("scalerl", "tiny_dense", ["parallel.ep=2", "parallel.trainer_devices=2"])
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        load_config("scalerl", "tiny_moe", ["parallel.tp=2"])
    ok = load_config("scalerl", "tiny_moe", ["parallel.tp=1", "parallel.ep=2", "parallel.trainer_devices=2"])
    assert ok.parallel.dp == 2


def test_row_budget_counts_the_interruption_phrase_and_sp_padding_at_start():
    run = load_config("scalerl", "llama4_scout_17bx16e", ["trainer.micro_batch_tokens=16400"])
    run.check_row_budget(phrase_tokens=16)  # 16,400 tokens: fits exactly (a multiple of TP 4)
    with pytest.raises(
        ConfigError, match=r"answer_tokens \+ 17 phrase tokens = 16401 tokens \(16404 padded to a multiple of 4\)"
    ):
        run.check_row_budget(phrase_tokens=17)
    assert load_config("scalerl", "tiny_dense").trainer.micro_batch_tokens >= 16384 + 20  # ScaleRL's row fits


def test_context_parallel_layouts_and_rows_are_checked_at_config():
    """CP multiplies the dense layout (world = tp x cp x pp x dp) and cuts every sequence into 2 x cp chunks: a row
    budget that cannot hold the longest sequence so padded is refused with the rule."""
    with pytest.raises(
        ConfigError, match=r"parallel.trainer_devices.*6 must be a multiple of tp x cp x pp = 1 x 4 x 1"
    ):
        load_config("scalerl-cpu", "cpu_demo", ["parallel.cp=4", "parallel.trainer_devices=6"])
    with pytest.raises(ConfigError, match=r"parallel.cp: must be >= 1"):
        load_config("scalerl-cpu", "cpu_demo", ["parallel.cp=0"])
    run = load_config("scalerl", "llama4_scout_17bx16e", ["parallel.cp=2", "trainer.micro_batch_tokens=16400"])
    assert run.parallel.dp == 8 and run.parallel.pad_multiple == 16  # 2 x cp chunks, each rank's part over TP 4
    with pytest.raises(ConfigError, match=r"16400 cannot hold .*\(16416 padded to 2 x cp = 4 chunks per sequence "
                       r"\(parallel.cp=2\), rows a multiple of 16\)"):  # fmt: skip
        run.check_row_budget(phrase_tokens=17)
    assert run.parallel.padded_row([16399, 5]) == 16416
    with pytest.raises(ConfigError, match=r"parallel.cp: 2 with trainer.layer_spec=local on GPUs"):
        load_config("scalerl", "llama3_8b", ["parallel.cp=2", "trainer.layer_spec=local"])
    assert load_config("scalerl-cpu", "cpu_demo", ["parallel.cp=2", "parallel.trainer_devices=2"]).parallel.cp == 2


def test_gpu_kernels_follow_transformer_engine_unless_forced(monkeypatch):
    import megatron.core.transformer
    from megatron.core.transformer import TransformerConfig

    from megatron_rl.config import PerformanceConfig, TrainerConfig
    from megatron_rl.trainer import model

    names = {f.name for f in dataclasses.fields(PerformanceConfig)}
    local = model.performance_settings(TrainerConfig(layer_spec="local"))
    assert set(local) == names and not any(local.values())
    forced = TrainerConfig(layer_spec="local", performance=PerformanceConfig(moe_grouped_gemm=True))
    assert model.performance_settings(forced)["moe_grouped_gemm"] is True

    # Transformer Engine on CUDA: every setting on unless forced off (the gradient-accumulation fusion only with
    # Apex's kernel as well), and each reaches megatron's field of its name. TransformerConfig itself refuses the
    # fused kernels without TE, so its arguments are checked.
    monkeypatch.setattr(model, "use_transformer_engine", lambda trainer: True)
    without_apex = model.performance_settings(TrainerConfig(), apex=False)
    assert without_apex["gradient_accumulation_fusion"] is False
    monkeypatch.setattr(model, "apex_wgrad_kernel", lambda: True)
    gpu = model.performance_settings(TrainerConfig())
    assert set(gpu) == names and all(v is True for v in gpu.values()), gpu
    assert without_apex == {**gpu, "gradient_accumulation_fusion": False}
    no_grouped = TrainerConfig(performance=PerformanceConfig(moe_grouped_gemm=False))
    assert model.performance_settings(no_grouped) == {**gpu, "moe_grouped_gemm": False}

    handed: dict = {}
    monkeypatch.setattr(megatron.core.transformer, "TransformerConfig", lambda **kwargs: handed.update(kwargs))
    run = load_config("scalerl-cpu", "tiny_moe")
    model.transformer_config(run.model, run.parallel, run.trainer)
    assert names <= {f.name for f in dataclasses.fields(TransformerConfig)}
    assert {name: handed.get(name) for name in names} == gpu
    run = load_config("scalerl-cpu", "tiny_moe", ["trainer.performance.apply_rope_fusion=false"])
    model.transformer_config(run.model, run.parallel, run.trainer)
    assert {name: handed.get(name) for name in names} == {**gpu, "apply_rope_fusion": False}


@pytest.mark.parametrize(("recipe", "model_name"), [("scalerl", "llama3_8b"), ("scalerl-cpu", "cpu_demo")])
def test_a_fusion_forced_on_where_its_kernel_is_missing_is_refused_at_config(recipe, model_name):
    with pytest.raises(ConfigError, match=r"trainer.performance.gradient_accumulation_fusion: true needs .* Apex"):
        load_config(recipe, model_name, ["trainer.performance.gradient_accumulation_fusion=true"])
    assert load_config(recipe, model_name, ["trainer.performance.gradient_accumulation_fusion=false"])


def test_recompute_module_megatron_cannot_run_on_cpu_is_refused_at_start():
    from megatron_rl.config import RecomputeConfig
    from megatron_rl.trainer.model import recompute_settings

    layernorm = RecomputeConfig(granularity="selective", modules=["core_attn", "layernorm"])
    with pytest.raises(ValueError, match="trainer.recompute.modules: 'layernorm' needs Transformer Engine"):
        recompute_settings(layernorm, te=False)
    assert recompute_settings(layernorm, te=True)["recompute_modules"] == ["core_attn", "layernorm"]
    full = recompute_settings(RecomputeConfig(granularity="full", method="block", num_layers=2), te=False)
    assert full == dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert recompute_settings(RecomputeConfig(), te=False) == dict(recompute_granularity=None)


@pytest.mark.parametrize(
    ("recipe", "model_name", "overrides", "refused"),
    [
        ("scalerl-cpu", "cpu_demo", [], True),  # a CPU run never has Transformer Engine
        ("scalerl", "llama3_8b", ["trainer.layer_spec=local"], True),
        ("scalerl", "llama3_8b", [], False),  # the GPU image's Transformer Engine
        ("scalerl", "llama3_8b", ["trainer.layer_spec=transformer_engine"], False),
    ],
)
def test_norm_recompute_is_refused_at_config_where_the_nodes_have_no_transformer_engine(
    recipe, model_name, overrides, refused
):
    """`check` refuses what the node's model build would: selective recompute of the norms without TE."""
    norms = ["trainer.recompute.granularity=selective", "trainer.recompute.modules=[core_attn,layernorm]"]
    if refused:
        with pytest.raises(ConfigError, match="trainer.recompute.modules: 'layernorm' needs Transformer Engine"):
            load_config(recipe, model_name, [*overrides, *norms])
    else:
        assert load_config(recipe, model_name, [*overrides, *norms]).trainer.recompute.modules[-1] == "layernorm"


@pytest.mark.parametrize("recipe", ["scalerl", "scalerl-cpu"])
@pytest.mark.parametrize("model_name", ["tiny_moe", "tiny_dense"])
@pytest.mark.parametrize("layer_spec", ["auto", "local"])
@pytest.mark.parametrize("grouped", [None, True, False])
def test_moe_act_recompute_refused_at_config_exactly_when_megatron_refuses(recipe, model_name, layer_spec, grouped):
    """megatron-core 0.19.2 refuses selective recompute of moe_act without grouped GEMM. The config check says
    so (naming the field) for the same settings megatron's TransformerConfig refuses: on a GPU run as the
    cluster resolves them (the plan's meta build), on a CPU run as this CPU host does."""
    from megatron_rl.config import RecomputeConfig, TrainerConfig
    from megatron_rl.trainer import model

    selective = RecomputeConfig(granularity="selective", modules=["core_attn", "moe_act"])
    trainer = TrainerConfig(layer_spec=layer_spec, recompute=selective)
    trainer.performance.moe_grouped_gemm = grouped
    plain = load_config(recipe, model_name)
    cfg, parallel = plain.model, plain.parallel
    try:
        model.transformer_config(cfg, parallel, trainer, meta=recipe == "scalerl")
        megatron_refuses = False
    except ValueError as exc:
        assert "moe_act in recompute_modules is only supported with moe_grouped_gemm" in str(exc)
        megatron_refuses = True
    overrides = ["trainer.recompute={granularity: selective, modules: [core_attn, moe_act]}"]
    grouped_text = "null" if grouped is None else str(grouped).lower()
    overrides += [f"trainer.layer_spec={layer_spec}", f"trainer.performance.moe_grouped_gemm={grouped_text}"]
    if megatron_refuses:
        with pytest.raises(ConfigError, match=r"trainer.recompute.modules: \['core_attn', 'moe_act'\] has 'moe_act'"):
            load_config(recipe, model_name, overrides)
    else:
        assert load_config(recipe, model_name, overrides).trainer.recompute.modules == ["core_attn", "moe_act"]


def test_model_layout_sets_the_split_unless_overridden():
    c = load_config("scalerl", "llama4_scout_17bx16e")
    assert (c.parallel.tp, c.parallel.ep, c.parallel.sequence_parallel, c.parallel.trainer_devices) == (4, 16, True, 64)
    assert c.rollout.engine.tp == 8 and c.rollout.engine.num_engines * c.rollout.engine.tp == 64
    assert (c.parallel.etp, c.parallel.expert_dp(True), c.trainer.recompute.granularity) == (1, 4, "full")
    no_recompute = load_config("scalerl", "llama4_scout_17bx16e", ["trainer.recompute.granularity=none"])
    assert no_recompute.trainer.recompute.granularity == "none"
    assert load_config("scalerl", "llama3_8b", ["parallel.tp=4"]).parallel.tp == 4


def test_unknown_recipe_and_model_list_the_known_ones():
    with pytest.raises(ConfigError, match="no such recipe 'nope'.*scalerl"):
        load_config("nope")
    with pytest.raises(ConfigError, match="no such model 'nope'.*tiny_dense"):
        load_config("scalerl", "nope")


def test_resolved_config_round_trips(tmp_path):
    c = load_config("loo-lp", "tiny_moe", ["parallel.ep=2", "parallel.trainer_devices=2", "rollout.k=3"])
    save_config(c, tmp_path / "config.yaml")
    assert load_resolved(tmp_path / "config.yaml") == c


def test_apply_overrides_does_not_mutate_input():
    data = {"algo": {"loss": "cispo"}}
    out = apply_overrides(data, ["algo.loss=dapo", "rollout.k=2"])
    assert data == {"algo": {"loss": "cispo"}} and out["algo"]["loss"] == "dapo" and out["rollout"]["k"] == 2


def test_build_rejects_wrong_types_with_path():
    with pytest.raises(ConfigError, match=r"rollout.engine: expected a mapping"):
        build(RunConfig, {"rollout": {"engine": 3}})
    with pytest.raises(ConfigError, match=r"trainer.fp32_lm_head: expected true or false"):
        build(RunConfig, {"trainer": {"fp32_lm_head": "maybe"}})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("checkpoint.every_steps=0", "checkpoint.every_steps: must be >= 1, got 0"),
        ("checkpoint.keep_last=-1", "checkpoint.keep_last: must be >= 1"),
        ("trainer.optimizer.lr=.nan", "trainer.optimizer.lr: expected a finite number, got nan"),
        ("trainer.optimizer.lr=.inf", "trainer.optimizer.lr: expected a finite number, got inf"),
        ("rewards.sandbox.workers=0", "rewards.sandbox.workers: must be >= 1, got 0"),
        ("rewards.sandbox.memory_mb=-5", "rewards.sandbox.memory_mb: must be >= 16"),
        ("rewards.sandbox.wall_time_s=-1", "rewards.sandbox.wall_time_s: must be >= 0 seconds"),
        ("rollout.engine.tp=0", "rollout.engine.tp: must be >= 1, got 0"),
        ("rollout.answer_tokens=0", "rollout.answer_tokens: must be >= 1, got 0"),
        ("data.val_prompts=0", "data.val_prompts: no dataset holds out validation prompts"),
        ("name=../../x", "name: must be one directory name inside output_dir"),
        ("name=a/b", "name: must be one directory name inside output_dir"),
        ("name=..", "name: must be one directory name inside output_dir"),
    ],
)
def test_values_out_of_range_stop_at_config_naming_the_field_and_the_rule(override, message):
    """Each of these used to pass the config and fail only once the stack was up (or, for `name`, to put the run
    directory outside output_dir)."""
    with pytest.raises(ConfigError) as info:
        load_config("scalerl-cpu", None, [override])
    assert message in str(info.value)


def test_routing_replay_and_mismatch_corrections_are_checked():
    from megatron_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="algo.routing_replay: routing replay needs an MoE model; cpu_demo is dense"):
        load_config("scalerl-cpu", None, ["algo.routing_replay=rollout"])
    with pytest.raises(ConfigError, match="algo.tis_cap: must be > 0"):
        load_config("scalerl-cpu", None, ["algo.tis_cap=0"])
    with pytest.raises(ConfigError, match="algo.mismatch_mask: must be > 1"):
        load_config("scalerl-cpu", None, ["algo.mismatch_mask=0.9"])
    assert load_config("scalerl-cpu", "tiny_moe", ["algo.routing_replay=measure"]).algo.routing_replay == "measure"


def test_a_cpu_engine_refuses_chunked_attention_it_cannot_serve():
    """SGLang's torch-native attention has no chunked local attention: a Llama-4 whose chunk is shorter than the
    longest sequence would be served with full attention, so the CPU run is refused naming the field."""
    from megatron_rl.config import ConfigError, load_config

    run = load_config("scalerl-cpu", "tiny_llama4", ["model.attention_chunk_size=64"])  # the trainer alone: fine
    with pytest.raises(ConfigError, match="model.attention_chunk_size: 64 is shorter than rollout.context_length"):
        run.check_engine_attention()
    load_config("scalerl-cpu", "tiny_llama4", ["model.attention_chunk_size=4096"]).check_engine_attention()
    load_config("scalerl", "llama4_scout_17bx16e", []).check_engine_attention()  # GPU engines chunk themselves
