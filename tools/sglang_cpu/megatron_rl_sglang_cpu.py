"""CPU shims for SGLang 0.5.23, imported at start-up by megatron_rl_sglang_cpu.pth in every process (the
server's scheduler and detokenizer processes included). Both act only when torch has no CUDA.

1. Import guard for torchvision's op registrations.

Why: SGLang imports torchvision (its multimodal processors and config modules use
`torchvision.transforms`). The only torchvision on the reachable registries is PyPI's CUDA-linked wheel:
its C++ extension does not load under CPU torch, so its ops (`torchvision::nms`, `roi_align`, ...) are
never registered, and `import torchvision` then dies in `torchvision/__init__.py` at
`_meta_registrations` (fake kernels for those ops): "RuntimeError: operator torchvision::nms does not
exist". The same holds for `_autograd_registrations`.

What: a `sys.meta_path` finder that answers for exactly those two modules, and only when CUDA is absent
and torchvision's ops are not registered, with an empty module, so the rest of torchvision (transforms,
datasets, the pure-Python parts) imports normally. Registering fake/autograd kernels for ops that do not
exist has nothing to do, so skipping them changes no behaviour; calling a torchvision op still fails with
torch's own "operator does not exist" error. With a working torchvision (GPU node, a CPU build) the
finder steps aside and the real modules load. Nothing in torchvision's files is modified.

Cost: one set lookup per import; `import torch` is never triggered by this module.

2. Batched decode and prefill attention for the torch-native backend.

Why: `TorchNativeAttnBackend._run_sdpa_forward_decode` (the attention of every decode step with
`--attention-backend torch_native`, the CPU path) loops over the running sequences in Python and calls SDPA
once per sequence per layer; with 256 sequences of a small model that loop was half of the scheduler's time
(benchmarks/README.md, "Default run"), and SGLang's own code marks it "inefficient, optimize later".

What: once that module is imported, the method is wrapped: for plain decode (no encoder, no cross attention,
no sliding window) every sequence's keys and values are gathered from the KV pool into one [sequences, kv
heads, longest, dim] tensor and one SDPA call attends with a padding mask, which is the same attention as the
loop (each query sees exactly its own sequence's cache) in one kernel call; the query heads that share a kv head
attend as that kv head's rows of queries, so the keys are not repeated per query head (SDPA's `enable_gqa`
repeats them: 1.6-2x the kernel's time at 256-1,024 sequences of the default run's model). Prefill
(`_run_sdpa_forward_extend`, the same per-sequence loop) is batched the same way with a causal mask offset by
each sequence's cached prefix, up to a size where padding would cost more than the loop. Any other case goes
to the original method. The keys and values are gathered with `index_select` on the flattened slots (4x
faster than indexing the pool with the [sequences, width] slot tensor at 1,024 sequences, the validation's
batch). The results are checked against the original methods on random caches
(tests/integration/generator/test_sglang_cpu.py), and the engine tests compare the served log-probs with transformers'.
Nothing in SGLang's files is modified; with CUDA present the module is left alone.

3. No full garbage collection in `flush_cache` on CPU.

Why: SGLang's CPU platform answers `empty_cache()` (the CUDA allocator's cache release, called by
`/flush_cache`) with a full `gc.collect()`, which walks every object of the scheduler's heap: 0.4-0.5 s each
time here. The trainer flushes the prefix cache after every weight push whenever the engine is idle (its KV
was computed with the old weights), so the engine sat paused ~0.4 s per step, a sixth of the default run.

What: `CpuDeviceMixin.empty_cache` collects the young generations only (`gc.collect(1)`, well under a
millisecond). There is no device cache to release on CPU; cyclic garbage is still collected by Python's
automatic collector as usual. The prefix cache itself is dropped exactly as before.

4. No CUDA host registration of host buffers on CPU.

Why: SGLang's routed-experts capturer (`--enable-return-routed-experts`, the generator's side of rollout
routing replay) allocates its host cache through `alloc_with_host_register(..., pin_memory=True)`, which calls
`torch.cuda.cudart().cudaHostRegister`: under CPU torch that raises "Torch not compiled with CUDA enabled"
and the scheduler dies at start-up.

What: `sglang.srt.mem_cache.pool_host.common._cuda_host_register` does nothing on CPU. Page-locking host
memory exists only to speed device copies; without a device the buffer is ordinary host memory, exactly as
allocated. Nothing else of the allocation changes.

5. Llama-4 attention in the model's dtype.

Why: SGLang's `Llama4Attention.forward` has a CUDA path (a fused QK-norm kernel) and a fallback for other
devices that casts q and k to bfloat16 around the L2 QK-norm, whatever the model's dtype. On CPU with an fp32
model, q and k then reach attention in bf16 while v is fp32, and the output projection fails ("expected m1
and m2 to have the same dtype"); with a bf16 model it would round q and k before the norm. Its fallback also
discards what the rotary embedding returns, relying on it writing into the q/k views in place.

What: on CPU, `Llama4Attention.forward` is replaced by one that runs the same submodules in the same order as
transformers' Llama-4 attention: qkv projection, RoPE on RoPE layers (its returned q and k), the L2 QK-norm in
fp32 and back to the activations' dtype, attention-temperature tuning on NoPE layers, attention, output
projection. The served log-probs are compared with transformers' (tests/integration/generator/test_sglang_families.py).

Two more defects of SGLang's text-only `Llama4ForCausalLM` (models/llama4.py) are corrected with it, on CPU:
(a) transformers' Llama-4 rotates interleaved pairs of each head's q/k channels (complex RoPE) while SGLang's
rotary embedding rotates halves; SGLang's multimodal `Llama4ForConditionalGeneration` (mllama4.py, the class
of real Scout checkpoints) reorders the q_proj/k_proj rows at load time to match (`permute_qk_weight_for_rotary`),
the text-only class does not. Its `load_weights` now reorders them the same way, for checkpoints and in-flight
weight updates alike. (b) `Llama4Attention` decides NoPE layers as every 4th layer (Scout's and Maverick's
pattern) instead of reading `config.no_rope_layers`; a layer whose config says otherwise gets its rotary
embedding and QK-norm set from the config after construction. Neither defect touches a Scout run on GPU (the
multimodal class, NoPE every 4th layer); they break any other Llama-4 text checkpoint, such as the tiny one.
(c) The text-only class loads through Llama's `load_weights`, which skips names it does not know: the fused
expert tensors of a checkpoint (`feed_forward.experts.gate_up_proj` / `down_proj`) and the per-expert weights of
an in-flight update (`feed_forward.experts.{e}.{gate,up,down}_proj.weight`) were never loaded and the routed
experts kept their initial values. Both now go into SGLang's FusedMoE parameters as the multimodal class puts
them (per expert, [out, in], gate as shard w1 and up as w3); a name with no such parameter is an error.

6. MoE with the router weight on the input (Llama-4) in the CPU MoE path.

Why: Llama-4's experts take the token already scaled by its router weight (`apply_router_weight_on_input`);
SGLang's CPU MoE (`fused_moe_native.moe_forward_native`, used when its AMX kernels are absent) raises
NotImplementedError for that.

What: that function is wrapped: with the weight on the input, each of the token's k choices runs as a top-1
call of the original on the token scaled by that choice's weight, with weight 1 at the output, and the k
results are summed; sum_j expert_j(w_j x) is exactly what the weight on the input means (transformers' Llama-4:
the routed input is x * sigmoid(score)). Every other case goes to the original unchanged.

7. The server's scheduler and detokenizer processes forked on CPU, not spawned.

Why: `_set_envs_and_config` (entrypoints/engine.py) sets multiprocessing's start method to "spawn", which a
CUDA parent needs (a forked child cannot use the parent's CUDA context). Each spawned child starts a fresh
interpreter and imports SGLang again (8-10 s of CPU each on a 2-core machine, the largest share of a CPU run's
start-up) and holds its own private copy of every imported module (~0.5 GB each of the run's memory).

What: on CPU, right after that function, the start method is set to "fork": the children start from the
server process's already imported modules, their pages shared copy-on-write. Nothing CUDA exists to inherit,
and the server has started no thread of its own when it launches them (its HTTP server and tokenizer manager
come after). The objects that exist at that moment (the imported modules') are moved to the collector's permanent
generation (`gc.freeze`), so a collection in a child does not write to, and so copy, the pages it shares with the
server. Everything else `_set_envs_and_config` does is kept; with CUDA present the module is left alone.

8. Sampling by inverse CDF on CPU.

Why: SGLang's `sampling_from_probs_torch` (the sampler for plain temperature sampling, no top-k/top-p/min-p)
draws with the Gumbel-max trick or `torch.multinomial`, both drawing a random number for every vocabulary entry
of every row: on CPU that was 2 ms per decode step for 128 sequences of a 512-token vocabulary and 14-17 ms for
1,024, more than the model's forward at those sizes.

What: without a per-request seed, each row draws one uniform u in [0, total) and takes the first token whose
cumulative probability exceeds u (`searchsorted`): the same distribution (inverse transform sampling), 20x
faster there. A zero-probability token is never drawn. The seeded (deterministic inference) path is SGLang's
own. Checked against the probabilities by frequency (tests/integration/generator/test_sglang_cpu.py).

9. `torch.compile` deferred to the first call in SGLang's processes on CPU.

Why: SGLang decorates ~50 functions with `torch.compile` at import (MoE runners, quantization, norms). Each
decoration only wraps the function (compilation waits for its first call), but the first one imports inductor
and AOTAutograd to resolve the backend: 160 more modules, 1.6-2.4 s of the server's import CPU on the engine's
start-up path (it is on the run's critical path) and ~40 MB in the server, shared by its forked children. On the
CPU path none of those functions is called (the CUDA/NPU kernels' helpers), so the work was for nothing.

What: once torch is imported and an `sglang` module is first imported (CPU only), `torch.compile` applied to a
plain function returns a wrapper that calls the real `torch.compile` with the same arguments at the wrapper's
first call and then runs what it returned: exactly what decorating did, later. Compiling a module, or anything
but a plain function, calls the real `torch.compile` at once; torch's own `torch.compiler.disable` is untouched.

10. The SGLang server process on CPU does not import SGLang's frontend language, nor every model.

Why: `import sglang` (the package, imported first by `python -m sglang.launch_server`) imports its frontend
language (`sglang.lang`: `sgl.gen`, `Runtime`, the OpenAI/Anthropic backends' HTTP client), which no server
process uses: ~1 s of the server's import CPU on the engine's start-up path. And SGLang's model registry imports
all ~250 of its model modules to find the one class a checkpoint names: ~1.1 s more in the scheduler.

What: in the server process of a CPU engine (`-m sglang.launch_server` with SGLANG_USE_CPU_ENGINE=1, set by
megatron_rl/generator/server.py), while `sglang/__init__.py` runs, its `from sglang.lang... import name` lines
bind names that import their module at first use (as that file already does for its backend clients, with
SGLang's `LazyImport`); afterwards `import sglang.lang...` imports the real modules as usual. And
SGLANG_EXTERNAL_MODEL_PACKAGE, unless set, names `megatron_rl_sglang_cpu_models`, which re-exports the entry
classes of SGLang's Llama and Qwen-3 modules (the CPU runs' architectures): SGLang's own switch for a package of
models registered first; any other architecture (a miss) makes the registry import all of SGLang's models as
before. The classes served are SGLang's own in both cases.

11. No post-warm-up GC freeze request from a CPU server that skips its warm-up.

Why: after its warm-up SGLang's server posts `/freeze_gc` to itself (`_freeze_gc_after_server_warmup`), so that
its processes freeze their objects out of the collector's reach. With `--skip-server-warmup` (the CPU engine's
command) it posts at once, before its HTTP listener is up: the request is refused and every start logged "post-warmup
freeze_gc failed" with a ~40-line ConnectionRefusedError traceback, in a log users read for errors.

What: on CPU, when the server skips its warm-up, that function does nothing. Nothing was frozen by it before either
(the request never arrived); the scheduler and detokenizer freeze the objects they inherit at the fork (7). With
the warm-up run, SGLang's function runs as is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types

GUARDED = frozenset({"torchvision._meta_registrations", "torchvision._autograd_registrations"})


def _needs_guard() -> bool:
    torch = sys.modules.get("torch")  # torchvision imports torch before these modules
    if torch is None or torch.cuda.is_available():
        return False
    try:
        torch.ops.torchvision.nms  # noqa: B018 - registered only when torchvision's C++ extension loaded
    except (AttributeError, RuntimeError):
        return True
    return False


class _EmptyModuleLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = (
            "Skipped by megatron_rl_sglang_cpu: torchvision's C++ ops are not registered under this CPU-only "
            "torch, so there are no fake/autograd kernels to register."
        )
        module.SKIPPED_BY_MEGATRON_RL = True


class TorchvisionRegistrationGuard(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in GUARDED or not _needs_guard():
            return None
        return importlib.machinery.ModuleSpec(fullname, _EmptyModuleLoader(), origin="megatron_rl_sglang_cpu")


TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend"


def _gather_cache(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, dtype):  # type: ignore[no-untyped-def]
    """Every sequence's cached keys and values padded to the longest: ([seqs, kv heads, width, dim] x 2,
    contiguous, and the [seqs, width] mask of the positions each sequence really has)."""
    import torch

    lengths = seq_lens.to(torch.long)
    width = int(lengths.max())
    valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    slots = req_to_token[req_pool_indices.to(torch.long), :width].to(torch.long)
    slots = torch.where(valid, slots, torch.zeros_like(slots))  # past a sequence's end: any slot, masked
    # index_select on flat rows, not k_cache[slots]: the same rows, 4x faster at 1,024 sequences on CPU. The rows
    # are one head's vector each, taken head-major, so the result is laid out [seqs, kv heads, width, dim]
    # already: SDPA on a transposed view of [seqs, width, kv heads, dim] ran ~2x slower.
    kv_heads = k_cache.shape[1]
    rows = (slots[:, None, :] * kv_heads + torch.arange(kv_heads, device=slots.device)[None, :, None]).view(-1)
    shape = (*slots.shape[:1], kv_heads, width)
    keys = k_cache.reshape(-1, k_cache.shape[-1]).index_select(0, rows).view(*shape, k_cache.shape[-1])
    values = v_cache.reshape(-1, v_cache.shape[-1]).index_select(0, rows).view(*shape, v_cache.shape[-1])
    if keys.dtype != dtype:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values, valid


def batched_decode(original):  # type: ignore[no-untyped-def]
    """`_run_sdpa_forward_decode` with one SDPA call over all sequences of a plain decode batch."""

    def run(  # type: ignore[no-untyped-def]
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        plain = encoder_lens is None and not is_cross_attn and not causal and query.shape[1] % k_cache.shape[1] == 0
        plain = plain and (sliding_window_size is None or sliding_window_size <= -1) and seq_lens.numel() > 0
        if not plain:
            return original(
                self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens,
                scaling, enable_gqa, causal, is_cross_attn, sliding_window_size,
            )  # fmt: skip
        import torch

        keys, values, valid = _gather_cache(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, query.dtype)
        seqs, heads, kv_heads = query.shape[0], query.shape[1], keys.shape[1]
        # One query token per sequence; the `heads // kv_heads` query heads sharing a kv head (head h reads kv
        # head h // group, as `enable_gqa` repeats them) go in as that kv head's query rows: one attention per
        # (sequence, kv head) on the keys as they are, instead of SDPA repeating the keys for every query head.
        queries = query.reshape(seqs, kv_heads, heads // kv_heads, query.shape[-1])
        # Scores, mask, softmax and the weighted sum as three plain ops, not SDPA: with a query row or two per
        # (sequence, kv head) SDPA's CPU kernel took 1.2-1.6x as long at 512-1,150 sequences (a validation's
        # batch) and the same at 16-128 (measured, one thread).
        scale = queries.shape[-1] ** -0.5 if scaling is None else scaling
        scores = torch.matmul(queries, keys.transpose(-1, -2)).mul_(scale)
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))  # every sequence has a position: no empty row
        out = torch.matmul(torch.softmax(scores, dim=-1), values)
        output.copy_(out.reshape(seqs, heads, values.shape[-1]))
        return output

    run.megatron_rl_original = original  # type: ignore[attr-defined]
    return run


BATCHED_EXTEND_MAX_SCORES = 1 << 26
"""Above this many attention scores (sequences x heads x longest extend x longest context) a prefill batch
keeps SGLang's per-sequence loop: padding every sequence to the longest would cost more than the loop."""


def batched_extend(original):  # type: ignore[no-untyped-def]
    """`_run_sdpa_forward_extend` (prefill: new tokens after a cached prefix) with one SDPA call over all
    sequences: query token i of a sequence with prefix p sees the cached keys 0 .. p + i, as in the loop."""

    def run(  # type: ignore[no-untyped-def]
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_prefix_lens,
        extend_seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        import torch

        plain = encoder_lens is None and not is_cross_attn and causal and seq_lens.numel() > 0
        plain = plain and (sliding_window_size is None or sliding_window_size <= -1)
        if plain:
            extend = extend_seq_lens.to(torch.long)
            width, longest = int(seq_lens.max()), int(extend.max())
            plain = seq_lens.numel() * query.shape[1] * longest * width <= BATCHED_EXTEND_MAX_SCORES
        if not plain:
            return original(
                self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn,
                sliding_window_size,
            )  # fmt: skip
        device = query.device
        rows = torch.arange(longest, device=device)
        starts = torch.cumsum(extend, 0) - extend
        asked = rows[None, :] < extend[:, None]  # [seqs, longest]: real query tokens
        token = torch.where(asked, starts[:, None] + rows[None, :], torch.zeros_like(asked, dtype=torch.long))
        queries = query[token].transpose(1, 2)  # [seqs, heads, longest, dim]
        keys, values, valid = _gather_cache(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, queries.dtype)
        position = extend_prefix_lens.to(torch.long)[:, None] + rows[None, :]  # each query token's position
        # causal within the sequence's own cache; every row sees key 0, so no row is fully masked
        columns = torch.arange(width, device=device)
        mask = (columns[None, None, :] <= position[:, :, None]) & valid[:, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask[:, None], scale=scaling, enable_gqa=enable_gqa
        )
        output[token[asked]] = out.transpose(1, 2)[asked]
        return output

    run.megatron_rl_original = original  # type: ignore[attr-defined]
    return run


def _patch_torch_native(module: types.ModuleType) -> None:
    backend = module.TorchNativeAttnBackend
    if not hasattr(backend._run_sdpa_forward_decode, "megatron_rl_original"):
        backend._run_sdpa_forward_decode = batched_decode(backend._run_sdpa_forward_decode)
    if not hasattr(backend._run_sdpa_forward_extend, "megatron_rl_original"):
        backend._run_sdpa_forward_extend = batched_extend(backend._run_sdpa_forward_extend)


def _young_collection() -> None:
    import gc

    gc.collect(1)


def _patch_cpu_platform(module: types.ModuleType) -> None:
    mixin = module.CpuDeviceMixin
    if not getattr(mixin.empty_cache, "megatron_rl_patched", False):

        def empty_cache(self) -> None:  # type: ignore[no-untyped-def]
            _young_collection()

        empty_cache.megatron_rl_patched = True  # type: ignore[attr-defined]
        mixin.empty_cache = empty_cache


def _no_host_register(buffer, granularity_bytes=None) -> None:  # type: ignore[no-untyped-def]
    """No page-locking on CPU: there is no device to copy to."""


def _patch_host_pools(module: types.ModuleType) -> None:
    module._cuda_host_register = _no_host_register


def _llama4_attention_forward(self, positions, hidden_states, forward_batch):  # type: ignore[no-untyped-def]
    import torch

    qkv, _ = self.qkv_proj(hidden_states)
    qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
    if self.rotary_emb is not None:
        q, k = self.rotary_emb(positions, *qk.split([self.q_size, self.kv_size], dim=-1))
        qk = torch.cat([q, k], dim=-1)
    if self.qk_norm is not None:
        heads = qk.reshape(-1, self.head_dim)
        qk = self.qk_norm(heads.float()).to(heads.dtype).reshape(-1, self.q_size + self.kv_size)
    q, k = qk.split([self.q_size, self.kv_size], dim=-1)
    if self.attn_temperature_tuning and not self.use_rope:
        q = (q * self._get_attn_scale(positions)).to(q.dtype)
    output, _ = self.o_proj(self.attn(q, k, v, forward_batch))
    return output


def _pairs_to_halves(weight, heads: int):  # type: ignore[no-untyped-def]
    """q_proj/k_proj rows from transformers' interleaved RoPE pairs to the rotate-halves layout, per head."""
    rows, columns = weight.shape
    return weight.view(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def _load_fused_experts(params, name: str, tensor) -> None:  # type: ignore[no-untyped-def]
    """transformers' fused expert tensors (gate_up_proj [E, H, 2I], gate then up; down_proj [E, I, H]) into
    SGLang's FusedMoE parameters (w13_weight with shards w1 = gate, w3 = up; w2_weight), one expert at a time."""
    if ".experts.gate_up_proj" in name:
        target, shards = name.replace(".experts.gate_up_proj", ".experts.w13_weight"), ("w1", "w3")
        parts = tensor.chunk(2, dim=-1)
    else:
        target, shards, parts = name.replace(".experts.down_proj", ".experts.w2_weight"), ("w2",), (tensor,)
    if target not in params:
        raise KeyError(f"Llama-4 expert weights {name}: the model has no parameter {target}")
    param = params[target]
    for shard, part in zip(shards, parts, strict=True):
        for expert in range(part.shape[0]):
            param.weight_loader(param, part[expert].T, target, shard_id=shard, expert_id=expert)


_EXPERT_SHARDS = {"gate_proj": ("w13_weight", "w1"), "up_proj": ("w13_weight", "w3"), "down_proj": ("w2_weight", "w2")}


def _load_one_expert(params, name: str, tensor) -> bool:  # type: ignore[no-untyped-def]
    """One expert's linear weight (`...feed_forward.experts.{e}.{gate,up,down}_proj.weight`, [out, in], the names
    of a weight push) into SGLang's FusedMoE parameters; False for any other name."""
    head, found, tail = name.partition(".feed_forward.experts.")
    parts = tail.split(".")
    if not found or len(parts) != 3 or not parts[0].isdigit() or parts[1] not in _EXPERT_SHARDS or parts[2] != "weight":
        return False
    param_name, shard = _EXPERT_SHARDS[parts[1]]
    target = f"{head}.feed_forward.experts.{param_name}"
    if target not in params:
        raise KeyError(f"Llama-4 expert weight {name}: the model has no parameter {target}")
    params[target].weight_loader(params[target], tensor, target, shard_id=shard, expert_id=int(parts[0]))
    return True


def llama4_text_load_weights(original):  # type: ignore[no-untyped-def]
    import functools

    @functools.wraps(original)
    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        config = self.config
        params = dict(self.named_parameters())

        def reordered():  # type: ignore[no-untyped-def]
            for name, tensor in weights:
                if ".experts.gate_up_proj" in name or ".experts.down_proj" in name:
                    _load_fused_experts(params, name, tensor)
                    continue
                if _load_one_expert(params, name, tensor):
                    continue
                if name.endswith("self_attn.q_proj.weight"):
                    tensor = _pairs_to_halves(tensor, config.num_attention_heads)
                elif name.endswith("self_attn.k_proj.weight"):
                    tensor = _pairs_to_halves(tensor, config.num_key_value_heads)
                yield name, tensor

        return original(self, reordered())

    load_weights.megatron_rl_original = original  # type: ignore[attr-defined]
    return load_weights


def llama4_attention_init(module: types.ModuleType, original):  # type: ignore[no-untyped-def]
    import functools
    import inspect

    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        config, layer_id = bound.arguments["config"], bound.arguments["layer_id"]
        layers = getattr(config, "no_rope_layers", None)
        use_rope = bool(layers[layer_id]) if layers else self.use_rope  # transformers: 1 = RoPE, 0 = NoPE
        if use_rope == self.use_rope:
            return
        self.use_rope = use_rope
        self.use_qk_norm = config.use_qk_norm and use_rope
        self.qk_norm = (
            module.RMSNorm(hidden_size=self.head_dim, eps=config.rms_norm_eps, has_weight=False)
            if self.use_qk_norm
            else None
        )
        rope_scaling = bound.arguments["rope_scaling"]
        self.rotary_emb = (
            module.get_rope(
                self.head_dim,
                rotary_dim=self.head_dim,
                max_position=bound.arguments["max_position_embeddings"],
                base=int(bound.arguments["rope_theta"]),
                rope_scaling=rope_scaling if rope_scaling != "default" else None,
                is_neox_style=True,
            )
            if use_rope
            else None
        )
        self.attn.use_irope = use_rope

    init.megatron_rl_original = original  # type: ignore[attr-defined]
    return init


def _patch_llama4(module: types.ModuleType) -> None:
    module.Llama4Attention.forward = _llama4_attention_forward
    if not hasattr(module.Llama4Attention.__init__, "megatron_rl_original"):
        module.Llama4Attention.__init__ = llama4_attention_init(module, module.Llama4Attention.__init__)
    causal = module.Llama4ForCausalLM
    if not hasattr(causal.load_weights, "megatron_rl_original"):
        causal.load_weights = llama4_text_load_weights(causal.load_weights)


def weight_on_input(original):  # type: ignore[no-untyped-def]
    import dataclasses
    import functools

    @functools.wraps(original)
    def run(layer, x, topk_output, moe_runner_config):  # type: ignore[no-untyped-def]
        if not moe_runner_config.apply_router_weight_on_input:
            return original(layer, x, topk_output, moe_runner_config)
        config = dataclasses.replace(moe_runner_config, apply_router_weight_on_input=False)
        weights, ids = topk_output.topk_weights, topk_output.topk_ids
        total = None
        for j in range(ids.shape[1]):
            one = topk_output._replace(
                topk_weights=weights[:, j : j + 1].new_ones(ids.shape[0], 1), topk_ids=ids[:, j : j + 1]
            )
            out = original(layer, x * weights[:, j : j + 1].to(x.dtype), one, config)
            total = out if total is None else total + out
        return total

    run.megatron_rl_original = original  # type: ignore[attr-defined]
    return run


def _patch_native_moe(module: types.ModuleType) -> None:
    if not hasattr(module.moe_forward_native, "megatron_rl_original"):
        module.moe_forward_native = weight_on_input(module.moe_forward_native)


def fork_children(original):  # type: ignore[no-untyped-def]
    """`_set_envs_and_config`, then the "fork" start method for the server's child processes (CPU only)."""

    def run(server_args):  # type: ignore[no-untyped-def]
        import gc
        import multiprocessing

        original(server_args)
        multiprocessing.set_start_method("fork", force=True)
        gc.freeze()  # the imported modules' objects: no collection in a child touches (and so copies) their pages

    run.megatron_rl_original = original  # type: ignore[attr-defined]
    return run


def inverse_cdf_sampling(original):  # type: ignore[no-untyped-def]
    """`sampling_from_probs_torch` drawing each row's token by inverse CDF: one uniform per row."""

    def run(probs, sampling_seed=None, positions=None):  # type: ignore[no-untyped-def]
        if sampling_seed is not None:  # deterministic inference: SGLang's seeded path, unchanged
            return original(probs, sampling_seed, positions)
        import torch

        cdf = probs.float().cumsum(dim=-1)
        uniform = torch.rand((probs.shape[0], 1), device=probs.device) * cdf[:, -1:]
        # The first token whose cumulative probability exceeds the draw: a zero-probability token never is.
        index = torch.searchsorted(cdf, uniform, right=True).clamp_max_(probs.shape[-1] - 1)
        return index.view(-1).to(torch.int32)

    run.megatron_rl_original = original  # type: ignore[attr-defined]
    return run


def _patch_sampler(module: types.ModuleType) -> None:
    if not hasattr(module.sampling_from_probs_torch, "megatron_rl_original"):
        module.sampling_from_probs_torch = inverse_cdf_sampling(module.sampling_from_probs_torch)


def no_freeze_without_warmup(original, serving):  # type: ignore[no-untyped-def]
    """`_freeze_gc_after_server_warmup`, skipped when the server skipped its warm-up (`serving()`'s flag)."""

    def run(server_args):  # type: ignore[no-untyped-def]
        if serving().skip_server_warmup:
            return None
        return original(server_args)

    run.megatron_rl_original = original  # type: ignore[attr-defined]
    return run


def _patch_http_server(module: types.ModuleType) -> None:
    original = module._freeze_gc_after_server_warmup
    if not hasattr(original, "megatron_rl_original"):
        module._freeze_gc_after_server_warmup = no_freeze_without_warmup(original, module.get_serving)


def _patch_engine_entrypoint(module: types.ModuleType) -> None:
    if not hasattr(module._set_envs_and_config, "megatron_rl_original"):
        module._set_envs_and_config = fork_children(module._set_envs_and_config)


def deferred_compile(compile):  # type: ignore[no-untyped-def]
    """`torch.compile` whose call on a plain function is made at that function's first call."""
    import functools

    def lazy(model=None, **options):  # type: ignore[no-untyped-def]
        if model is None:  # `@torch.compile(dynamic=True, ...)`: the decorator
            return lambda fn: lazy(fn, **options)
        if not isinstance(model, types.FunctionType):
            return compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal compiled
            if compiled is None:
                compiled = compile(model, **options)
            return compiled(*args, **kwargs)

        return run

    lazy.megatron_rl_original = compile  # type: ignore[attr-defined]
    return lazy


def _defer_torch_compile(torch: types.ModuleType) -> None:
    if not hasattr(torch.compile, "megatron_rl_original"):
        torch.compile = deferred_compile(torch.compile)


PATCHES = {
    TORCH_NATIVE: _patch_torch_native,
    "sglang.srt.platforms.cpu": _patch_cpu_platform,
    "sglang.srt.mem_cache.pool_host.common": _patch_host_pools,
    "sglang.srt.models.llama4": _patch_llama4,
    "sglang.srt.layers.moe.fused_moe_native": _patch_native_moe,
    "sglang.srt.entrypoints.engine": _patch_engine_entrypoint,
    "sglang.srt.layers.sampler": _patch_sampler,
    "sglang.srt.entrypoints.http_server": _patch_http_server,
}
"""Module -> the patch applied right after SGLang's module is executed (CPU only)."""


FRONTEND = (
    "sglang.lang.api",
    "sglang.lang.backend.runtime_endpoint",
    "sglang.lang.choices",
    "sglang.lang.global_config",
)
"""The frontend modules `sglang/__init__.py` imports names from."""

MODELS = "megatron_rl_sglang_cpu_models"


def _cpu_server() -> bool:
    """This process is the SGLang server of a CPU engine (decided without importing torch)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" and "sglang.launch_server" in argv


class Deferred:
    """A name of SGLang's frontend that imports its module at first use (call or attribute)."""

    def __init__(self, module: str, name: str) -> None:
        self.megatron_rl_module, self.megatron_rl_name = module, name

    def megatron_rl_target(self):  # type: ignore[no-untyped-def]
        module = importlib.import_module(self.megatron_rl_module)
        if getattr(module, "megatron_rl_stand_in", False):  # used while sglang/__init__.py still runs
            raise AttributeError(f"{self.megatron_rl_module}.{self.megatron_rl_name} is imported after `import sglang`")
        return getattr(module, self.megatron_rl_name)

    def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.megatron_rl_target()(*args, **kwargs)

    def __getattr__(self, attr: str):  # type: ignore[no-untyped-def]
        if attr.startswith("megatron_rl_"):
            raise AttributeError(attr)
        return getattr(self.megatron_rl_target(), attr)


def _deferred_module(name: str) -> types.ModuleType:
    def deferred(attr: str) -> Deferred:
        if attr.startswith("__"):  # a module's own attributes (`__file__`, ...): a stand-in has none
            raise AttributeError(attr)
        return Deferred(name, attr)

    module = types.ModuleType(name, "Stands in for SGLang's frontend module while sglang/__init__.py runs.")
    module.megatron_rl_stand_in = True  # type: ignore[attr-defined]
    module.__getattr__ = deferred  # type: ignore[method-assign]
    return module


class _FrontendDeferred(importlib.abc.Loader):
    """Runs `sglang/__init__.py` with the frontend modules standing in, then removes them from sys.modules."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        stand_ins = {name: _deferred_module(name) for name in FRONTEND if name not in sys.modules}
        sys.modules.update(stand_ins)
        try:
            self.loader.exec_module(module)
        finally:
            for name, stand_in in stand_ins.items():
                if sys.modules.get(name) is stand_in:
                    del sys.modules[name]


class _PatchAfterLoad(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch) -> None:  # type: ignore[no-untyped-def]
        self.loader, self.patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class SGLangCpuPatches(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.compile_deferred = False

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "sglang" and _cpu_server():
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
            if spec is not None and spec.loader is not None:
                spec.loader = _FrontendDeferred(spec.loader)
            return spec
        if not self.compile_deferred and fullname.startswith("sglang"):
            torch = sys.modules.get("torch")
            if torch is not None:  # decided once, with torch imported (SGLang imports it first)
                self.compile_deferred = True
                if not torch.cuda.is_available():
                    _defer_torch_compile(torch)
        if fullname not in PATCHES:
            return None
        torch = sys.modules.get("torch")
        if torch is None or torch.cuda.is_available():
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchAfterLoad(spec.loader, PATCHES[fullname])
        return spec


def install() -> None:
    if _cpu_server():
        os.environ.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", MODELS)
    if not any(isinstance(finder, TorchvisionRegistrationGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionRegistrationGuard())
    if not any(isinstance(finder, SGLangCpuPatches) for finder in sys.meta_path):
        sys.meta_path.insert(0, SGLangCpuPatches())


install()
