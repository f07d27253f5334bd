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
loop (each query sees exactly its own sequence's cache) in one kernel call. Prefill
(`_run_sdpa_forward_extend`, the same per-sequence loop) is batched the same way with a causal mask offset by
each sequence's cached prefix, up to a size where padding would cost more than the loop. Any other case goes
to the original method. The results are checked against the original methods on random caches
(tests/integration/test_sglang_cpu.py), and the engine tests compare the served log-probs with transformers'.
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
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
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
    """Every sequence's cached keys and values padded to the longest: ([seqs, kv heads, width, dim] x 2, and
    the [seqs, width] mask of the positions each sequence really has)."""
    import torch

    lengths = seq_lens.to(torch.long)
    width = int(lengths.max())
    valid = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
    slots = req_to_token[req_pool_indices.to(torch.long), :width].to(torch.long)
    slots = torch.where(valid, slots, torch.zeros_like(slots))  # past a sequence's end: any slot, masked
    keys, values = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)
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
        plain = encoder_lens is None and not is_cross_attn and not causal
        plain = plain and (sliding_window_size is None or sliding_window_size <= -1) and seq_lens.numel() > 0
        if not plain:
            return original(
                self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens,
                scaling, enable_gqa, causal, is_cross_attn, sliding_window_size,
            )  # fmt: skip
        import torch

        queries = query.unsqueeze(2)  # [seqs, heads, 1, dim]: one query token per sequence
        keys, values, valid = _gather_cache(k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, queries.dtype)
        out = torch.nn.functional.scaled_dot_product_attention(
            queries, keys, values, attn_mask=valid[:, None, None, :], scale=scaling, enable_gqa=enable_gqa
        )
        output.copy_(out.squeeze(2))
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


PATCHES = {
    TORCH_NATIVE: _patch_torch_native,
    "sglang.srt.platforms.cpu": _patch_cpu_platform,
    "sglang.srt.mem_cache.pool_host.common": _patch_host_pools,
}
"""Module -> the patch applied right after SGLang's module is executed (CPU only)."""


class _PatchAfterLoad(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch) -> None:  # type: ignore[no-untyped-def]
        self.loader, self.patch = loader, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class SGLangCpuPatches(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
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
    if not any(isinstance(finder, TorchvisionRegistrationGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionRegistrationGuard())
    if not any(isinstance(finder, SGLangCpuPatches) for finder in sys.meta_path):
        sys.meta_path.insert(0, SGLangCpuPatches())


install()
