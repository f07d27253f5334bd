"""HF <-> megatron name/shape mappings without megatron: round trips, layouts, configs and error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.config import load_config
from megatron_rl.convert.hf_files import HFReader, ShardedWriter, parse_size
from megatron_rl.convert.hf_import import check_hf_tensors
from megatron_rl.models import (
    HFMapper,
    family,
    family_of,
    from_hf,
    hf_configs,
    hf_shapes,
    layers,
    model_config_from_hf,
)
from megatron_rl.models.tiny import build_tiny_model
from megatron_rl.trainer.weights import _join_tp, _split_tp

FAMILY_MODELS = {
    "llama": ("tiny_dense", ["model.rope_scaling_factor=8.0", "model.rope_original_max_position=256"]),
    "qwen3_tied": ("tiny_qwen3", []),
    "qwen3_untied": ("tiny_qwen3", ["model.tie_word_embeddings=false"]),
    "qwen3_moe": ("tiny_moe", []),
    "llama4": ("tiny_llama4", ["model.rope_scaling_factor=16.0", "model.rope_high_freq_factor=1.0"]),
    # every 2nd layer MoE (Maverick's interleave_moe_layer_step, Qwen3-MoE's decoder_sparse_step): layer 0 dense
    "llama4_interleaved": ("tiny_llama4", ["model.moe.layer_freq=2"]),
    "qwen3_moe_interleaved": ("tiny_moe", ["model.moe.layer_freq=2"]),
}


def model_cfg(key: str):
    name, overrides = FAMILY_MODELS[key]
    return load_config("scalerl-cpu", name, overrides).model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {key: build_tiny_model(root / key, model_cfg(key), seed=5, std=0.08) for key in FAMILY_MODELS}


@pytest.mark.parametrize("key", list(FAMILY_MODELS))
def test_hf_to_megatron_to_hf_is_bit_identical(hf_dirs, key):
    cfg = model_cfg(key)
    reader = HFReader(hf_dirs[key])
    canonical = [(recipe.name, recipe.build(reader)) for recipe in from_hf(cfg)]
    back = dict(HFMapper(cfg).map_all(canonical))
    original = load_file(hf_dirs[key] / "model.safetensors")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[name], original[name]) for name in original)
    shapes = hf_shapes(cfg, [(name, tuple(t.shape)) for name, t in canonical])
    assert shapes == {name: tuple(t.shape) for name, t in original.items()}


def test_canonical_names_per_family(hf_dirs):
    names = {key: [r.name for r in from_hf(model_cfg(key))] for key in FAMILY_MODELS}
    assert "output_layer.weight" not in names["qwen3_tied"] and "output_layer.weight" in names["qwen3_untied"]
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in names["qwen3_moe"]
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in names["qwen3_moe"]
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1.weight" in names["llama4"]
    assert not any("layernorm.weight" in n and "self_attention" in n for n in names["llama4"])  # weightless L2 norm


def test_llama4_fused_experts_are_transposed_per_expert_slices(hf_dirs):
    cfg = model_cfg("llama4")
    original = load_file(hf_dirs["llama4"] / "model.safetensors")
    recipes = {r.name: r for r in from_hf(cfg)}
    reader = HFReader(hf_dirs["llama4"])
    fc1 = recipes["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"].build(reader)
    gate_up = original["model.layers.1.feed_forward.experts.gate_up_proj"]  # [experts, hidden, 2 * ffn]
    ffn = cfg.moe.ffn_hidden_size
    assert torch.equal(fc1[:ffn], gate_up[2, :, :ffn].T) and torch.equal(fc1[ffn:], gate_up[2, :, ffn:].T)
    # a stack is emitted only when its last expert arrives, and an incomplete one is an error
    mapper = HFMapper(cfg)
    assert mapper.map("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", fc1) == []
    with pytest.raises(ValueError, match=r"gate_up_proj.*\[0, 1, 3\]"):
        mapper.finish()


def test_qkv_grouping_follows_query_groups():
    cfg = load_config("scalerl-cpu", "cpu_demo", []).model  # 4 heads, 2 KV groups, head_dim 32
    qkv = torch.randn((cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.head_dim, cfg.hidden_size)
    q, k, v = layers.split_qkv(qkv, cfg)
    dim = cfg.head_dim
    # group 0 = rows [q-head 0, q-head 1, k-head 0, v-head 0], group 1 likewise
    assert torch.equal(q[: 2 * dim], qkv[: 2 * dim]) and torch.equal(k[:dim], qkv[2 * dim : 3 * dim])
    assert torch.equal(v[dim:], qkv[7 * dim :])
    assert torch.equal(layers.join_qkv(q, k, v, cfg), qkv)
    with pytest.raises(ValueError, match=r"k_proj: expected shape \(64, 128\)"):
        layers.join_qkv(q, k[:-1], v, cfg)


def test_glu_tensor_parallel_shards_are_gate_and_up_slices():
    gate, up = torch.arange(8.0)[:, None].expand(8, 3), 100 + torch.arange(8.0)[:, None].expand(8, 3)
    full = torch.cat([gate, up])
    shards = [_split_tp(full, 0, 2, rank, glu=True) for rank in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[4:], up[4:]]))
    assert torch.equal(_join_tp(shards, 0, glu=True), full)
    assert torch.equal(_join_tp([_split_tp(full, 1, 3, r, glu=False) for r in range(3)], 1, glu=False), full)


@pytest.mark.parametrize("key", list(FAMILY_MODELS))
def test_config_json_round_trips_to_the_model_config(hf_dirs, key):
    cfg = model_cfg(key)
    from_json = model_config_from_hf(hf_dirs[key])
    assert from_json.family == cfg.family
    assert hf_configs.differences(cfg, from_json) == []


def test_config_differences_name_the_field():
    cfg, other = model_cfg("qwen3_moe"), model_cfg("qwen3_moe")
    other.moe.router_topk, other.norm_epsilon = 1, 1e-5
    diffs = hf_configs.differences(cfg, other)
    assert diffs == [
        "model.moe.router_topk (config 2, config.json 1)",
        "model.norm_epsilon (config 1e-06, config.json 1e-05)",
    ]


def test_scout_multimodal_config_reads_its_text_model():
    text = family("llama4").hf_config(model_cfg("llama4"))
    scout = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"], "text_config": text}
    cfg = family("llama4").model_config(scout, "scout")
    assert cfg.family == "llama4" and cfg.moe.num_experts == 4 and cfg.no_rope_freq == 2 and cfg.qk_l2_norm
    assert family("llama4").checkpoint_prefix({"language_model.model.embed_tokens.weight"}) == "language_model."


@pytest.mark.parametrize("no_rope_layers", [[], None, "missing"], ids=["empty", "null", "missing"])
def test_scout_config_json_derives_nope_layers_and_attention_rules_as_transformers(no_rope_layers):
    from transformers import Llama4TextConfig

    # Scout's config.json as published: no_rope_layers [], attn_temperature_tuning 4 (an int), chunk 8192.
    text = {**family("llama4").hf_config(model_cfg("llama4")), "num_hidden_layers": 8, "no_rope_layer_interval": 4}
    text.update(attention_chunk_size=8192, attn_temperature_tuning=4, floor_scale=8192, attn_scale=0.1)
    text.update(max_position_embeddings=10485760)
    del text["moe_layers"]
    if no_rope_layers == "missing":
        del text["no_rope_layers"]
    else:
        text["no_rope_layers"] = no_rope_layers
    cfg = family("llama4").model_config(text, "scout")
    hf_args = {k: v for k, v in text.items() if k not in ("model_type", "architectures")}
    hf = Llama4TextConfig(**{**hf_args, "attn_temperature_tuning": True})  # transformers 5 types it as a bool
    assert hf.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]  # transformers: every 4th layer is NoPE
    assert cfg.no_rope_freq == 4
    assert cfg.attention_chunk_size == 8192 and cfg.attn_temperature_tuning is True
    assert (cfg.floor_scale, cfg.attn_scale) == (8192, 0.1)
    written = family("llama4").hf_config(cfg)
    assert written["no_rope_layers"] == hf.no_rope_layers and written["attention_chunk_size"] == 8192


def test_llama4_without_chunking_writes_a_chunk_that_never_cuts():
    cfg = model_cfg("llama4")
    assert cfg.attention_chunk_size is None
    written = family("llama4").hf_config(cfg)
    assert written["attention_chunk_size"] == cfg.max_position_embeddings
    assert family("llama4").model_config(written, "x").attention_chunk_size is None


def test_unknown_architecture_and_unsupported_settings_are_named():
    with pytest.raises(ValueError, match="unknown architecture.*'gpt2'.*GPT2LMHeadModel"):
        family_of({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="no conversion for 'mixtral'"):
        family("mixtral")
    cfg = model_cfg("llama4")
    cfg.moe.router_topk = 2
    with pytest.raises(ValueError, match="router_topk"):
        HFMapper(cfg)
    yarn = {**family("qwen3").hf_config(model_cfg("qwen3_tied")), "rope_parameters": {"rope_type": "yarn"}}
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported"):
        family("qwen3").model_config(yarn, "x")


def test_missing_extra_and_misshaped_hf_tensors_are_listed(hf_dirs, tmp_path):
    cfg = model_cfg("qwen3_untied")
    tensors = load_file(hf_dirs["qwen3_untied"] / "model.safetensors")
    reader = HFReader(hf_dirs["qwen3_untied"])
    canonical = [(r.name, tuple(r.build(reader).shape)) for r in from_hf(cfg)]
    shapes = hf_shapes(cfg, canonical)
    needed = {hf for r in from_hf(cfg) for hf in r.reads}
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    tensors["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(3)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].clone()
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError) as info:
        check_hf_tensors(HFReader(broken), cfg, needed, shapes)
    message = str(info.value)
    assert "1 missing tensors: model.layers.1.self_attn.k_norm.weight" in message
    assert "1 unexpected tensors: model.layers.0.mlp.gate_proj.bias" in message
    assert "1 shape mismatches: lm_head.weight (expected (512, 64), got (511, 64))" in message


def test_sharded_writer_streams_planned_shards_and_indexes(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    tensors["big"] = torch.zeros(600)  # larger than a shard: alone
    tensors["half"] = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    plan = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    writer = ShardedWriter(tmp_path, parse_size("1KB"), plan)
    with pytest.raises(ValueError, match="expected HF tensor 't0' next, got 't1'"):
        writer.add("t1", tensors["t1"])
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    files = writer.close()
    assert [f.name for f in files] == [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 5 * 400 + 2400 + 12
    assert index["weight_map"]["big"] == "model-00004-of-00005.safetensors"
    reader = HFReader(tmp_path)
    assert all(torch.equal(reader.get(name), tensor) for name, tensor in tensors.items())
    assert parse_size("2GiB") == 2 << 30 and parse_size(123) == 123
    with pytest.raises(ValueError, match="expected a size"):
        parse_size("lots")
    incomplete = ShardedWriter(tmp_path / "partial", 1000, plan)
    incomplete.add("t0", tensors["t0"])
    with pytest.raises(ValueError, match="6 planned HF tensors were never written"):
        incomplete.close()


def test_export_refuses_a_model_config_that_differs_from_the_checkpoints(tmp_path):
    import dataclasses

    from megatron_rl.convert.hf_export import checkpoint_model_config, resolve_checkpoint

    with pytest.raises(FileNotFoundError, match="not a megatron-core distributed checkpoint"):
        resolve_checkpoint(tmp_path)
    saved = model_cfg("qwen3_moe")
    meta = {"step": 3, "model": dataclasses.asdict(saved), "parallel": {"tp": 1, "pp": 1, "ep": 2}}
    (tmp_path / "megatron_rl.json").write_text(json.dumps(meta))
    cfg, _ = checkpoint_model_config(tmp_path, None)
    assert cfg == saved
    other = model_cfg("qwen3_moe")
    other.moe.num_experts = 8
    with pytest.raises(ValueError, match=r"requested one: model.moe.num_experts \(checkpoint 4, requested 8\)"):
        checkpoint_model_config(tmp_path, other)
    with pytest.raises(ValueError, match="model.family \\(checkpoint 'qwen3_moe', requested 'llama'\\)"):
        checkpoint_model_config(tmp_path, model_cfg("llama"))
