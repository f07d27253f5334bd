"""Hugging Face <-> Megatron on real megatron-core: import into TP/PP/EP layouts, logits equal transformers',
full-weight gather/scatter, weight-sync names, export of checkpoints saved under TP=2 / PP=2 / EP=2.

Megatron's parallel state is process-global, so megatron runs in fresh processes: convert_worker.py (one or
two ranks, several layouts one after another) and the `megatron-rl convert` command line.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config import load_config

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))  # test_trainer, trainer_worker
from test_trainer import _run  # noqa: E402
from trainer_worker import fixed_batch  # noqa: E402

WORKER = Path(__file__).with_name("convert_worker.py")
REPO = Path(__file__).parents[3]
MODELS = {
    # Llama-3.1 RoPE scaling on (original length 256, so that the tiny model's frequencies straddle both cut-offs)
    "llama": ("tiny_dense", ["model.rope_scaling_factor=8.0", "model.rope_original_max_position=256"]),
    "qwen3_tied": ("tiny_qwen3", []),
    "qwen3_untied": ("tiny_qwen3", ["model.tie_word_embeddings=false"]),
    "qwen3_moe": ("tiny_moe", []),
    # Scout's RoPE scaling (factor 16, low = high frequency factor 1), NoPE on layer 1, shared + routed experts
    "llama4": ("tiny_llama4", ["model.rope_scaling_factor=16.0", "model.rope_high_freq_factor=1.0"]),
    # every 2nd layer MoE (Maverick's interleave_moe_layer_step, Qwen3-MoE's decoder_sparse_step): layer 0 dense
    "llama4_interleaved": ("tiny_llama4", ["model.moe.layer_freq=2"]),
    "qwen3_moe_interleaved": ("tiny_moe", ["model.moe.layer_freq=2"]),
}
LAYOUTS = {  # 2-rank jobs: (model, tp, pp, ep)
    "llama_tp2": ("llama", 2, 1, 1),
    "qwen3_tied_pp2": ("qwen3_tied", 1, 2, 1),
    "qwen3_moe_ep2": ("qwen3_moe", 1, 1, 2),
    "llama4_ep2": ("llama4", 1, 1, 2),
    "llama4_pp2": ("llama4", 1, 2, 1),
}
LOGITS_TOLERANCE = 1e-5


def _tokens(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (7, 33)]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)


def _workers(tmp: Path, jobs: list[dict], world: int) -> list[dict]:
    from megatron_rl.ports import free_port

    spec = json.dumps({"out": str(tmp / "results.pt"), "jobs": jobs})
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), spec],
            env=_env(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=400)[0] for p in procs]
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return torch.load(tmp / "results.pt", weights_only=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "convert", *args], env=_env(), capture_output=True, text=True
    )


def _transformers_logits(hf_dir: Path, tokens: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([row])).logits[0] for row in tokens]


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _assert_bit_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    different = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not different, different


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    from megatron_rl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for key, (name, overrides) in MODELS.items():
        dirs[key] = build_tiny_model(root / key, load_config("scalerl-cpu", name, overrides).model, seed=11, std=0.08)
    return dirs


@pytest.fixture(scope="module")
def reference_logits(hf_dirs) -> dict[str, list[torch.Tensor]]:
    return {key: _transformers_logits(path, _tokens()) for key, path in hf_dirs.items()}


def _job(key: str, hf_dirs: dict[str, Path], tp: int = 1, pp: int = 1, ep: int = 1, save: str | None = None) -> dict:
    name, overrides = MODELS[key]
    return {"model": name, "overrides": overrides, "hf": str(hf_dirs[key]), "tokens": _tokens(), "tp": tp, "pp": pp,
            "ep": ep, "save": save}  # fmt: skip


def _check_job(result: dict, key: str, hf_dirs: dict[str, Path], reference: list[torch.Tensor]) -> float:
    worst = max((a - b).abs().max().item() for a, b in zip(result["logits"], reference, strict=True))
    assert worst < LOGITS_TOLERANCE, f"{key}: megatron vs transformers logits differ by {worst}"
    assert result["full_equal"], f"{key}: iter_full_weights differs from the TP=1 tensors built from the HF files"
    assert result["reload_equal"], f"{key}: load_full_weights -> iter_full_weights is not the identity"
    assert result["shapes_match"], f"{key}: megatron's full shapes differ from convert.canonical_shapes(cfg)"
    original = _hf_tensors(hf_dirs[key])
    _assert_bit_identical(result["hf"], original)  # weight sync: HF names and tensors
    _assert_bit_identical(result["hf_direct"], original)
    return worst


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, hf_dirs) -> dict[str, dict]:
    jobs = [{**_job(key, hf_dirs), "errors": key == "qwen3_moe"} for key in MODELS]
    results = _workers(tmp_path_factory.mktemp("one_rank"), jobs, world=1)
    return dict(zip(MODELS, results, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("key", list(MODELS))
def test_import_matches_transformers_for_every_family(key, one_rank, hf_dirs, reference_logits):
    worst = _check_job(one_rank[key], key, hf_dirs, reference_logits[key])
    print(f"max |logits - transformers| for {key} at TP=PP=EP=1: {worst:.2e}")


@pytest.mark.slow
def test_load_errors_list_names_and_layout_mismatch_is_refused(one_rank):
    errors = one_rank["qwen3_moe"]["errors"]
    assert "1 unexpected tensors: decoder.layers.0.mlp.experts.local_experts.9.linear_fc1.weight" in errors["load"]
    assert "1 missing tensors: decoder.final_layernorm.weight" in errors["load"]
    assert "shape mismatches: embedding.word_embeddings.weight (expected (512, 64), got (512, 63))" in errors["load"]
    assert "layout mismatch" in errors["layout"] and "tp/pp/ep=(1, 1, 1)" in errors["layout"]


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory, hf_dirs) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("two_rank")
    jobs = [
        _job(model, hf_dirs, tp, pp, ep, save=str(root / layout)) for layout, (model, tp, pp, ep) in LAYOUTS.items()
    ]
    results = _workers(root, jobs, world=2)
    return {layout: {**result, "checkpoint": root / layout} for layout, result in zip(LAYOUTS, results, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_rank_layouts_match_transformers_and_gather_the_same_weights(
    layout, two_rank, one_rank, hf_dirs, reference_logits
):
    model = LAYOUTS[layout][0]
    worst = _check_job(two_rank[layout], model, hf_dirs, reference_logits[model])
    print(f"max |logits - transformers| at {layout}: {worst:.2e}")
    assert two_rank[layout]["names"] == one_rank[model]["names"]  # the TP=PP=EP=1 order, whatever the layout


@pytest.mark.slow
def test_checkpoints_saved_under_tp2_pp2_ep2_export_bit_identically(tmp_path, two_rank, hf_dirs, reference_logits):
    script = (
        "import sys; from megatron_rl.convert.cli import main\n"
        "for ckpt, out in zip(sys.argv[1::2], sys.argv[2::2]):\n"
        "    assert main(['--to-hf', ckpt, '--out', out, '--shard-size', '100KB', '--no-progress']) == 0\n"
    )
    pairs = [(str(two_rank[layout]["checkpoint"]), str(tmp_path / layout)) for layout in LAYOUTS]
    done = subprocess.run(
        [sys.executable, "-c", script, *[p for pair in pairs for p in pair]], env=_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for layout, (model, *_) in LAYOUTS.items():
        out = tmp_path / layout
        _assert_bit_identical(_hf_tensors(out), _hf_tensors(hf_dirs[model]))
        assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
        assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= {
            p.name for p in out.iterdir()
        }
        logits = _transformers_logits(out, _tokens())
        assert all(torch.equal(a, b) for a, b in zip(logits, reference_logits[model], strict=True)), layout


@pytest.mark.slow
def test_cli_imports_for_an_expert_parallel_layout_and_exports_back(tmp_path, hf_dirs):
    checkpoint, out = tmp_path / "ckpt", tmp_path / "hf"
    done = _cli("--from-hf", str(hf_dirs["qwen3_moe"]), "--out", str(checkpoint), "--ep", "2", "--params-dtype", "fp32")
    assert done.returncode == 0, done.stderr[-4000:]
    meta = json.loads((checkpoint / "megatron_rl.json").read_text())
    assert meta["parallel"]["ep"] == 2 and meta["model"]["family"] == "qwen3_moe" and meta["step"] == 0
    tool = [
        sys.executable,
        str(REPO / "tools" / "convert_checkpoint.py"),
        "--to-hf",
        str(checkpoint),
        "--out",
        str(out),
    ]
    done = subprocess.run(tool, env=_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    _assert_bit_identical(_hf_tensors(out), _hf_tensors(hf_dirs["qwen3_moe"]))
    again = _cli("--to-hf", str(checkpoint), "--out", str(out))
    assert again.returncode == 1 and "already holds safetensors files" in again.stderr


def test_cli_errors_are_one_line(tmp_path, hf_dirs):
    (tmp_path / "bogus").mkdir()
    (tmp_path / "bogus" / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2"]}))
    done = _cli("--from-hf", str(tmp_path / "bogus"), "--out", str(tmp_path / "x"))
    assert done.returncode == 1 and "unknown architecture" in done.stderr and "Traceback" not in done.stderr
    done = _cli("--from-hf", str(hf_dirs["llama"]), "--out", str(tmp_path / "y"), "--model", "tiny_qwen3")
    assert done.returncode == 1 and "config.json is a llama model, model.family is 'qwen3'" in done.stderr
    done = _cli("--to-hf", str(tmp_path), "--out", str(tmp_path / "z"))
    assert done.returncode == 1 and "not a megatron-core distributed checkpoint" in done.stderr


@pytest.mark.slow
def test_trainer_imports_and_its_own_checkpoint_exports_back(tmp_path, hf_dirs):
    """The RL trainer's fp32 log-probs (trainer/step.py) on an imported TP=2 model match transformers, and the
    checkpoint it saves (trainer/checkpoint.py: model + optimizer, `latest` marker) exports bit-identically."""
    from transformers import AutoModelForCausalLM

    hf, root = hf_dirs["llama"], tmp_path / "checkpoints"
    overrides = [*MODELS["llama"][1], "parallel.tp=2", "parallel.trainer_devices=2", "trainer.params_dtype=fp32"]
    spec = {"model": "tiny_dense", "hf": str(hf), "overrides": overrides, "save": str(root)}
    result = _run(tmp_path, "trainer", spec, world=2)[0]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    expected = []
    for group in fixed_batch(vocab=512):
        for c in group.completions:
            ids = torch.tensor([c.prompt_tokens + c.tokens])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0].double(), -1)
            expected.append([float(logp[i - 1, ids[0, i]]) for i in range(len(c.prompt_tokens), ids.shape[1])])
    pairs = zip(result["logprobs"], expected, strict=True)
    assert max(abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True)) < 1e-4
    done = _cli("--to-hf", str(root), "--out", str(tmp_path / "hf"), "--hf-source", str(hf), "--no-progress")
    assert done.returncode == 0, done.stderr[-4000:]
    _assert_bit_identical(_hf_tensors(tmp_path / "hf"), _hf_tensors(hf))

    # Without --hf-source: the tokenizer of the model the run recorded as its start (a run directory holds
    # `checkpoints/` and starting_model.json), so that the export of any run loads with its tokenizer.
    from transformers import AutoTokenizer

    from megatron_rl.trainer.checkpoint import record_starting_model

    done = _cli("--to-hf", str(root), "--out", str(tmp_path / "bare"))
    assert done.returncode == 0 and "no tokenizer files" in done.stderr
    record_starting_model(tmp_path, hf)
    done = _cli("--to-hf", str(root), "--out", str(tmp_path / "recorded"))
    assert done.returncode == 0, done.stderr[-4000:]
    text = "What is 12 + 30?"
    assert AutoTokenizer.from_pretrained(tmp_path / "recorded")(text) == AutoTokenizer.from_pretrained(hf)(text)
