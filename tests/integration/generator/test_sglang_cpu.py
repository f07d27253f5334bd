"""The CPU shims installed for SGLang (tools/sglang_cpu): the batched decode and prefill attention of the
torch-native backend give the attention of SGLang's own per-sequence loops; the server's children are forked on CPU."""

from __future__ import annotations

import pytest
import torch

torch_native = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")


def _decode_batch(seed: int, heads: int, kv_heads: int, dim: int, lengths: list[int]) -> dict:
    g = torch.Generator().manual_seed(seed)
    pool, width = 4096, max(lengths) + 7
    req_to_token = torch.zeros(64, width, dtype=torch.int32)
    free = torch.randperm(pool - 1, generator=g)[: sum(lengths)] + 1  # scattered cache slots, 0 unused
    rows = torch.randperm(64, generator=g)[: len(lengths)]
    used = 0
    for row, n in zip(rows.tolist(), lengths, strict=True):
        req_to_token[row, :n] = free[used : used + n].to(torch.int32)
        req_to_token[row, n:] = torch.randint(0, pool, (width - n,), generator=g, dtype=torch.int32)  # stale slots
        used += n
    return dict(
        query=torch.randn(len(lengths), heads, dim, generator=g),
        k_cache=torch.randn(pool, kv_heads, dim, generator=g),
        v_cache=torch.randn(pool, kv_heads, dim, generator=g),
        req_to_token=req_to_token,
        req_pool_indices=rows,
        seq_lens=torch.tensor(lengths),
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "lengths"),
    [(4, 2, [1, 17, 40, 3, 64]), (4, 4, [9]), (8, 2, [5, 5, 5, 5]), (4, 1, list(range(1, 70, 3)))],
)
def test_batched_decode_equals_the_per_sequence_loop(heads: int, kv_heads: int, lengths: list[int]) -> None:
    run = torch_native.TorchNativeAttnBackend._run_sdpa_forward_decode
    assert hasattr(run, "megatron_rl_original"), "the CPU shim did not patch the torch-native decode"
    batch = _decode_batch(0, heads, kv_heads, 32, lengths)
    outputs = []
    for method in (run, run.megatron_rl_original):
        out = torch.full((len(lengths), heads, 32), float("nan"))
        query, k_cache, v_cache = batch["query"], batch["k_cache"], batch["v_cache"]
        kwargs = dict(scaling=32**-0.5, enable_gqa=heads != kv_heads)
        method(
            None,
            query,
            out,
            k_cache,
            v_cache,
            batch["req_to_token"],
            batch["req_pool_indices"],
            batch["seq_lens"],
            **kwargs,
        )
        outputs.append(out)
    batched, loop = outputs
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "prefixes", "extends"),
    [(4, 2, [0, 16, 3, 40], [12, 1, 30, 7]), (4, 4, [0], [25]), (8, 1, [0, 0, 0], [9, 9, 9])],
)
def test_batched_prefill_equals_the_per_sequence_loop(
    heads: int, kv_heads: int, prefixes: list[int], extends: list[int]
) -> None:
    """Prefill after a cached prefix (the radix cache's hit, or an interruption's second request): token i of
    a sequence attends to the cache up to its own position, whatever the other sequences' lengths."""
    run = torch_native.TorchNativeAttnBackend._run_sdpa_forward_extend
    assert hasattr(run, "megatron_rl_original"), "the CPU shim did not patch the torch-native prefill"
    lengths = [p + e for p, e in zip(prefixes, extends, strict=True)]
    batch = _decode_batch(2, heads, kv_heads, 32, lengths)
    query = torch.randn(sum(extends), heads, 32, generator=torch.Generator().manual_seed(3))
    outputs = []
    for method in (run, run.megatron_rl_original):
        out = torch.full((sum(extends), heads, 32), float("nan"))
        tensors = [batch[k] for k in ("k_cache", "v_cache", "req_to_token", "req_pool_indices", "seq_lens")]
        method(
            None, query, out, *tensors, torch.tensor(prefixes), torch.tensor(extends),
            scaling=32**-0.5, enable_gqa=heads != kv_heads, causal=True,
        )  # fmt: skip
        outputs.append(out)
    batched, loop = outputs
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=1e-6)


def test_other_decode_cases_take_sglangs_own_path() -> None:
    """A sliding window is left to SGLang's loop: the result equals the original method's exactly."""
    run = torch_native.TorchNativeAttnBackend._run_sdpa_forward_decode
    batch = _decode_batch(1, 4, 2, 32, [12, 30])

    class Backend:  # the original reads only this helper from `self` on the sliding-window path
        _make_sliding_window_mask = staticmethod(torch_native.TorchNativeAttnBackend._make_sliding_window_mask)

    outputs = []
    for method in (run, run.megatron_rl_original):
        out = torch.zeros(2, 4, 32)
        method(
            Backend(), batch["query"], out, batch["k_cache"], batch["v_cache"], batch["req_to_token"],
            batch["req_pool_indices"], batch["seq_lens"], scaling=None, enable_gqa=True, sliding_window_size=8,
        )  # fmt: skip
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])


def test_flush_cache_on_cpu_does_not_walk_the_whole_heap() -> None:
    """SGLang's CPU `empty_cache` (run by every `/flush_cache`, after each weight push) collects the young
    generations only; its full `gc.collect()` took ~0.4 s per push."""
    import gc

    from sglang.srt.platforms.cpu import CpuDeviceMixin

    generations: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(record)
    try:
        CpuDeviceMixin.empty_cache(None)
    finally:
        gc.callbacks.remove(record)
    assert generations and max(generations) < 2, generations


def test_server_children_are_forked_on_cpu() -> None:
    """The server's scheduler and detokenizer processes are forked from its already imported modules on CPU
    (SGLang sets "spawn" for CUDA's sake; each spawned child imported SGLang again and held its own copy)."""
    import multiprocessing

    import megatron_rl_sglang_cpu
    from sglang.srt.entrypoints import engine

    assert engine._set_envs_and_config.megatron_rl_original is not None  # the installed patch wraps SGLang's
    before = multiprocessing.get_start_method(allow_none=True)
    seen: list[str | None] = []

    def sglangs(server_args: object) -> None:  # what SGLang's own function does to the start method
        multiprocessing.set_start_method("spawn", force=True)
        seen.append(multiprocessing.get_start_method())

    try:
        megatron_rl_sglang_cpu.fork_children(sglangs)(None)
        assert seen == ["spawn"] and multiprocessing.get_start_method() == "fork"
    finally:
        multiprocessing.set_start_method(before, force=True)


def test_cpu_sampling_draws_each_token_with_its_probability() -> None:
    """The installed sampler (inverse CDF on CPU) draws tokens at their probabilities: frequencies over 200,000
    rows within 4.5 standard errors of each probability, zero-probability tokens never, a one-hot row always its
    token; a seeded request keeps SGLang's own path."""
    from sglang.srt.layers import sampler

    sample = sampler.sampling_from_probs_torch
    assert sample.megatron_rl_original is not None  # the installed patch wraps SGLang's
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.05, 0.0, 0.5, 0.3, 0.15, 0.0, 0.0])
    rows = 200_000
    drawn = sample(probs.repeat(rows, 1))
    assert drawn.dtype == torch.int32 and drawn.shape == (rows,)
    frequency = torch.bincount(drawn.long(), minlength=probs.numel()).double() / rows
    error = (probs.double() * (1 - probs.double()) / rows).sqrt()
    assert torch.all((frequency - probs.double()).abs() <= 4.5 * error + 1e-12), frequency
    assert frequency[probs == 0].sum() == 0
    one_hot = torch.zeros(64, 512)
    one_hot[torch.arange(64), torch.arange(64) * 7] = 1.0
    assert torch.equal(sample(one_hot).long(), torch.arange(64) * 7)

    import megatron_rl_sglang_cpu

    calls: list[tuple] = []
    recorded = megatron_rl_sglang_cpu.inverse_cdf_sampling(lambda *args: calls.append(args) or "sglang's")
    seed, positions = torch.tensor([7]), torch.tensor([3])
    assert recorded(probs[None], seed, positions) == "sglang's" and calls[0][1] is seed and calls[0][2] is positions


def test_torch_compile_waits_for_the_first_call_of_what_it_compiles() -> None:
    """In SGLang's processes on CPU, `torch.compile` on a plain function calls the real one (same options) at the
    function's first call and runs what it returned; a module is compiled at once."""
    import megatron_rl_sglang_cpu

    calls: list[tuple[object, dict]] = []

    def real(model: object, **options: object) -> object:
        calls.append((model, options))
        return lambda *args, **kwargs: ("compiled", model(*args, **kwargs))

    lazy = megatron_rl_sglang_cpu.deferred_compile(real)

    @lazy(dynamic=True, backend="inductor")
    def double(x: int, scale: int = 2) -> int:
        return x * scale

    @lazy
    def plain(x: int) -> int:
        return x + 1

    assert calls == [] and double.__name__ == "double"  # decorating compiled nothing
    assert double(3, scale=5) == ("compiled", 15) and plain(1) == ("compiled", 2)
    assert double(4) == ("compiled", 8)
    assert [options for _, options in calls] == [{"dynamic": True, "backend": "inductor"}, {}]  # once each
    module = torch.nn.Linear(2, 2)
    lazy(module, mode="default")
    assert calls[-1] == (module, {"mode": "default"})


def test_importing_sglang_on_cpu_leaves_inductor_unimported() -> None:
    """The server's imports decorate ~50 functions with `torch.compile`; none imports inductor's compiler any more
    (it cost 1.6-2.4 s of the engine's start-up), and a deferred function still compiles and runs when called."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "import sglang.srt.layers.quantization, sglang.srt.layers.moe.moe_runner.deep_gemm as dg\n"
        "assert torch.compile.megatron_rl_original is not None\n"
        "inductor = sum(m.startswith('torch._inductor') for m in sys.modules)\n"
        "print(inductor, 'torch._functorch.aot_autograd' in sys.modules)\n"
        "f = torch.compile(lambda x: x * 2, backend='eager')\n"  # a lambda is a plain function: deferred too
        "def g(x): return torch.sin(x) + 1\n"
        "h = torch.compile(g, backend='eager')\n"
        "x = torch.arange(4.0)\n"
        "assert torch.equal(h(x), torch.sin(x) + 1) and torch.equal(f(x), x * 2)\n"
        "print('torch._dynamo.eval_frame' in sys.modules)\n"
    )
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    inductor, aot, dynamo = out.stdout.split()
    assert int(inductor) < 40 and aot == "False", out.stdout  # 181 inductor modules and AOTAutograd before
    assert dynamo == "True"


SERVER_PROCESS = (
    "import sys, megatron_rl_sglang_cpu\n"
    "sys.orig_argv = [sys.executable, '-m', 'sglang.launch_server']\n"
    "megatron_rl_sglang_cpu.install()\n"  # as the .pth does at the start of the server's interpreter
)
"""Makes a `python -c` process the server of a CPU engine to the shim (`python -m sglang.launch_server`)."""


def _server_process(code: str, **env: str) -> str:
    import os
    import subprocess
    import sys

    env = {**{k: v for k, v in os.environ.items() if k != "SGLANG_EXTERNAL_MODEL_PACKAGE"}, **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_cpu_server_imports_sglangs_frontend_only_when_used() -> None:
    """`import sglang` in a CPU engine's server leaves the frontend language (`sglang.lang`, ~1 s of the engine's
    start-up) unimported; its names still work when used, and `import sglang.lang.api` gives the real module. In
    any other process `import sglang` is SGLang's own."""
    code = SERVER_PROCESS + (
        "import sglang\n"
        "print(any(m.startswith('sglang.lang') for m in sys.modules))\n"
        "print(sglang.global_config.default_backend is None)\n"  # first use: the real global_config
        "print(any(m.startswith('sglang.lang') for m in sys.modules))\n"
        "import sglang.lang.api as api\n"
        "print(api.gen is sglang.gen.megatron_rl_target(), type(api).__name__)\n"
        "print(callable(sglang.gen) and sglang.gen(name='x', max_tokens=3).__class__.__name__)\n"
    )
    lines = _server_process(code, SGLANG_USE_CPU_ENGINE="1").split()
    assert lines == ["False", "True", "True", "True", "module", "SglGen"], lines
    other = _server_process(SERVER_PROCESS + "import sglang\nprint('sglang.lang.api' in sys.modules)\n")
    assert other.split() == ["True"]  # not a CPU engine (no SGLANG_USE_CPU_ENGINE): SGLang's own import


def test_a_cpu_server_imports_only_the_models_it_serves() -> None:
    """SGLang's registry imports every one of its ~250 model modules to find a class (~1 s of the scheduler's
    start); a CPU server registers the Llama and Qwen-3 classes first, and any other architecture still resolves
    to SGLang's class after a full import."""
    code = SERVER_PROCESS + (
        "import sglang\n"
        "from sglang.srt.models.registry import ModelRegistry\n"
        "from sglang.srt.models.llama import LlamaForCausalLM\n"
        "cls, arch = ModelRegistry.resolve_model_cls(['LlamaForCausalLM'])\n"
        "print(cls is LlamaForCausalLM, arch)\n"
        "print(sum(m.startswith('sglang.srt.models.') for m in sys.modules) < 20)\n"
        "cls, arch = ModelRegistry.resolve_model_cls(['Llama4ForCausalLM'])\n"
        "import sglang.srt.models.llama4 as llama4\n"
        "print(cls is llama4.Llama4ForCausalLM, arch)\n"
        "print(sum(m.startswith('sglang.srt.models.') for m in sys.modules) > 150)\n"
    )
    lines = _server_process(code, SGLANG_USE_CPU_ENGINE="1").split()
    assert lines == ["True", "LlamaForCausalLM", "True", "True", "Llama4ForCausalLM", "True"], lines
