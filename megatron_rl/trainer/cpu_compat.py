"""megatron-core on a machine without CUDA: the one place where its CUDA-only calls are redirected.

megatron-core assumes a GPU in a few hundred places. On CPU (laptops, CI) we run it for real with gloo
and the local layer spec, so `apply()` redirects those calls to CPU equivalents. It is applied only when
`torch.cuda.is_available()` is False and changes nothing on a GPU machine.

What is patched, and why (docs/cpu.md §3):

1. Inside every loaded `megatron.core.*` module, the global name `torch` is replaced by `_CpuTorch`, a
   proxy that forwards everything to torch except:
   - tensor factories (`zeros`, `empty`, `tensor`, `ones`, `full`, `arange`, ...) called with a CUDA
     `device=` (megatron writes `device="cuda"` or `device=torch.cuda.current_device()` for scalars,
     masks, rotary buffers, the pipeline schedule's token counter, clip-grad norms);
   - `torch.distributed.all_to_all_single`, which gets its numpy split sizes as lists (gloo's binding
     rejects numpy arrays; the MoE alltoall dispatcher passes them);
   - `torch.cuda`, which becomes `_CpuCuda`: `current_device()` is the CPU device, streams and events
     are no-ops (the MoE alltoall dispatcher, DDP and the optimizers create them), `synchronize()` and
     `empty_cache()` do nothing (checkpoint saving calls them), and the RNG calls act on the CPU
     generator (the model-parallel RNG tracker).
   Only megatron's modules see the proxy; torch itself and every other library are untouched.
2. `megatron.core.tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`: the RNG
   tracker's fork/restore on the CPU generator.
3. `torch.Tensor.type()` without arguments reports CPU float tensors as `torch.cuda.*Tensor`: the
   distributed and mixed-precision optimizers refuse parameters whose type string is not a CUDA one.
4. `torch.Tensor.cuda()` returns the tensor itself (a few megatron paths move buffers explicitly).
5. `megatron.core.optimizer.cpu_offloading.HybridDeviceOptimizer._get_sub_optimizer_param_groups` and
   `._move_new_state_to_right_device` (optimizer CPU offload): megatron picks the parameters to offload by
   `param.is_cuda`, pins their host copies, and moves the device optimizer's loaded state with `.to("cuda")`.
   On CPU the trainer's own parameters stand for the device's, the host copy is an unpinned clone, and loaded
   state stays on the CPU; the same rule (the first `offload_fraction` of the elements, in parameter order)
   and the same maps, so the offloaded update, the copy back and the state handling run megatron's code.
6. `megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd` (RoPE on packed THD rows):
   the CPU stand-in for Transformer Engine's fused THD RoPE, which GPU runs use (`apply_rope_fusion`).
   megatron's unfused fallback splits the row into its sequences and rotates each in a Python loop (one
   slice, rotation and copy per sequence, per layer, for q and for k, and again in the backward): ~15% of a
   CPU trainer step. Here each local token's position in its own sequence (under CP, in the rank's two
   chunks) is computed once from `cu_seqlens`, the frequencies are gathered for all tokens at once and the
   row is rotated in one call of megatron's own `_apply_rotary_pos_emb_bshd`: the same positions and the same
   elementwise arithmetic as the loop, so the same values bit for bit (tests/integration/trainer/test_trainer.py).
   Frequencies given per packed token (`freqs` as long as the whole row) go to megatron's function unchanged.

7. `torch.compile` while the bodies of `megatron.core.jit` and `megatron.core.transformer.moe.router` run
   (`eager_compile`, entered by `megatron_rl.trainer.MegatronImports` when those modules are first imported): a no-op
   decorator. megatron's `jit_fuser` then stays the function itself, so the fused activations, the L2 q/k norm and
   the MoE router's expert bias run eagerly (the same arithmetic, without a CPU inductor compile at their
   first call), and nothing imports inductor (63 MB per rank).

`PATCHED_SYMBOLS` lists every megatron-core symbol the layer relies on; `check_symbols()` (and the canary
test `test_cpu_compat_symbols_exist` in tests/integration/trainer/test_trainer.py) fails with the missing names if a
megatron-core upgrade renames one, instead of a confusing CUDA error deep in a forward pass.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

PATCHED_SYMBOLS: dict[str, tuple[str, ...]] = {
    "megatron.core.tensor_parallel.random": ("_get_cuda_rng_state", "_set_cuda_rng_state", "CudaRNGStatesTracker"),
    "megatron.core.pipeline_parallel.schedules": ("forward_backward_no_pipelining", "get_forward_backward_func"),
    "megatron.core.optimizer.clip_grads": ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"),
    "megatron.core.optimizer.distrib_optimizer": ("DistributedOptimizer",),
    "megatron.core.transformer.moe.token_dispatcher": ("MoEAlltoAllTokenDispatcher", "MoEAllGatherTokenDispatcher"),
    "megatron.core.dist_checkpointing.strategies.filesystem_async": ("FileSystemWriterAsync",),
    "megatron.core.dist_checkpointing.strategies.torch": ("TorchDistSaveShardedStrategy",),
    "megatron.core.distributed.finalize_model_grads": ("finalize_model_grads",),
    "megatron.core.optimizer.cpu_offloading.hybrid_optimizer": ("HybridDeviceOptimizer",),
    "megatron.core.models.common.embeddings.rope_utils": ("_apply_rotary_pos_emb_thd", "_apply_rotary_pos_emb_bshd"),
}

PRELOADED_PACKAGES = ("megatron.core.dist_checkpointing",)
"""Packages whose modules megatron imports lazily in the middle of a call (checkpoint saving): imported
up front by `apply()` so that their `torch` is the CPU proxy too."""

_FACTORIES = (
    "arange",
    "as_tensor",
    "empty",
    "empty_like",
    "empty_strided",
    "eye",
    "full",
    "full_like",
    "linspace",
    "ones",
    "ones_like",
    "rand",
    "randint",
    "randn",
    "randperm",
    "tensor",
    "zeros",
    "zeros_like",
)
_CPU = torch.device("cpu")
_applied = False


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn: Any) -> Any:
    def factory(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        return fn(*args, **kwargs)

    factory.__name__ = fn.__name__
    return factory


def _cpu_device(*args: Any, **kwargs: Any) -> torch.device:
    if args and _is_cuda(args[0]):
        return _CPU
    return torch.device(*args, **kwargs)


class _NullStream:
    """A CUDA stream or event that does nothing (CPU work is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: _NullStream()  # e.g. stream.record_event() -> an event

    def query(self) -> bool:
        return True


class _CpuCuda(types.ModuleType):
    """`torch.cuda` as megatron-core sees it on a CPU machine."""

    Stream = Event = ExternalStream = _NullStream

    def __init__(self) -> None:
        super().__init__("megatron_rl.trainer.cpu_compat.cuda")
        self.random = types.SimpleNamespace(get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def device_count() -> int:
        return 0

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _NullStream:
        return _NullStream()

    default_stream = current_stream

    @staticmethod
    def stream(*args: Any, **kwargs: Any) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    empty_cache = set_device = synchronize

    @staticmethod
    def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def is_current_stream_capturing() -> bool:
        return False


class _Distributed(types.ModuleType):
    """`torch.distributed` with split sizes given as numpy arrays accepted by `all_to_all_single`.

    megatron's MoE alltoall dispatcher moves its split sizes to host memory as numpy arrays, which
    torch 2.13's gloo binding rejects (it wants a sequence of ints)."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    @staticmethod
    def all_to_all_single(
        output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None, **kw: Any
    ) -> Any:
        as_list = lambda sizes: sizes.tolist() if hasattr(sizes, "tolist") else sizes  # noqa: E731
        return torch.distributed.all_to_all_single(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), **kw
        )


class _CpuTorch(types.ModuleType):
    """`torch` as megatron-core's modules see it on a CPU machine (attribute lookups are cached)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        self.distributed = _Distributed()
        self.device = _cpu_device
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)
        return value


_TORCH = _CpuTorch()


def _tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    if dtype is None:
        name = _ORIGINAL_TYPE(self)
        return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
    return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


_ORIGINAL_TYPE = torch.Tensor.type


def _cpu_sub_optimizer_param_groups(self: Any, offload_fraction: float) -> tuple[Any, ...]:
    """HybridDeviceOptimizer's split into (host groups, device groups, device param -> host copy, host copy -> device
    param, param -> fp32 copy) with the trainer's CPU parameters in the device's place (patch 5)."""
    params = [param for group in self.param_groups for param in group["params"]]
    threshold = sum(param.numel() for param in params) * offload_fraction
    offloaded = 0
    host_groups, device_groups = [], []
    device_to_host, host_to_device, fp32_copies = {}, {}, {}
    for group in self.param_groups:
        host_group, device_group = {**group, "params": []}, {**group, "params": []}
        for original in group["params"]:
            param, on_host = original, False
            if offloaded < threshold:
                param, on_host = original.detach().clone(), True
                offloaded += param.numel()
            if self.param_update_in_fp32 and param.dtype != torch.float32:
                param = param.detach().clone().float()
                fp32_copies[original] = param
            if on_host:
                device_to_host[original], host_to_device[param] = param, original
            (host_group if on_host else device_group)["params"].append(param)
        host_groups += [host_group] if host_group["params"] else []
        device_groups += [device_group] if device_group["params"] else []
    return host_groups, device_groups, device_to_host, host_to_device, fp32_copies


def _cpu_move_new_state(self: Any) -> None:
    """HybridDeviceOptimizer's placement of loaded state, every sub-optimizer's on the CPU (patch 5)."""
    for optimizer in self.sub_optimizers:
        for param, state in optimizer.state.items():
            original = self.inner_param_to_orig_param.get(param, param)
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.state[original][key] = state[key] = value.to(_CPU)


def thd_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Each local token's position in its own sequence, as megatron's THD RoPE assigns them: with CP, a rank
    holds chunks `cp_rank` and `2 cp - 1 - cp_rank` of every sequence (trainer/context_parallel.py)."""
    local = (cu_seqlens[1:] - cu_seqlens[:-1]).long() // cp_size
    starts = torch.cumsum(local, 0) - local
    index = torch.arange(int(local.sum()), device=cu_seqlens.device)
    offset = index - torch.repeat_interleave(starts, local)  # position within the rank's part of the sequence
    if cp_size == 1:
        return offset
    chunk = torch.repeat_interleave(local // 2, local)
    full = torch.repeat_interleave(local * cp_size, local)
    front = cp_rank * chunk + offset
    back = full - (cp_rank + 1) * chunk + (offset - chunk)
    return torch.where(offset < chunk, front, back)


def _rope_thd(original: Any) -> Any:
    from megatron.core.models.common.embeddings import rope_utils

    def rope_thd(
        t: torch.Tensor,
        cu_seqlens: torch.Tensor,
        freqs: torch.Tensor,
        rotary_interleaved: bool = False,
        mla_rotary_interleaved: bool = False,
        mscale: float = 1.0,
        cp_group: Any = None,
        multi_latent_attention: bool | None = None,
    ) -> torch.Tensor:
        per_token = freqs.dim() >= 1 and freqs.size(0) == int(cu_seqlens[-1])
        if cp_group is None or multi_latent_attention is not None or per_token:
            return original(
                t, cu_seqlens, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, cp_group,
                multi_latent_attention,
            )  # fmt: skip
        positions = thd_positions(cu_seqlens, cp_group.size(), cp_group.rank())
        rotated = rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            freqs[positions],
            rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved,
            mscale=mscale,
        )
        return rotated.squeeze(1)

    rope_thd.megatron_rl_original = original  # type: ignore[attr-defined]
    return rope_thd


def check_symbols() -> None:
    """Fail clearly when a megatron-core upgrade removed or renamed something this layer patches."""
    missing = []
    for module_name, names in PATCHED_SYMBOLS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{module_name} ({exc})")
            continue
        missing += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    if missing:
        raise RuntimeError(
            "megatron_rl.trainer.cpu_compat: megatron-core no longer has "
            + ", ".join(missing)
            + "; update the CPU compatibility layer for this megatron-core version"
        )


def _patch_loaded_modules() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _TORCH  # type: ignore[attr-defined]


def _no_compile(model: Any = None, **kwargs: Any) -> Any:
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def eager_compile() -> Iterator[bool]:
    """On a host without CUDA, `torch.compile` is a no-op decorator for the duration (item 7 above); yields whether
    it is. Process-wide while it lasts: meant only around a module body being imported."""
    if torch.cuda.is_available():
        yield False
        return
    compile_ = torch.compile
    torch.compile = _no_compile  # type: ignore[assignment]
    try:
        yield True
    finally:
        torch.compile = compile_


def apply() -> bool:
    """Apply the CPU redirections if CUDA is absent; idempotent. Returns whether they are active.

    Call it after importing the megatron-core modules in use (megatron_rl.trainer does, once); modules
    that megatron imports lazily later are covered by calling it again (cheap).
    """
    global _applied
    if torch.cuda.is_available():
        return False
    for module_name in PATCHED_SYMBOLS:
        importlib.import_module(module_name)
    for package_name in PRELOADED_PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            with contextlib.suppress(ImportError):  # optional backends (e.g. zarr) may be absent
                importlib.import_module(info.name)
    check_symbols()
    if not _applied:
        from megatron.core.tensor_parallel import random as mp_random

        mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()  # type: ignore[assignment]
        mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)  # type: ignore[assignment]
        torch.Tensor.type = _tensor_type  # type: ignore[method-assign,assignment]
        torch.Tensor.cuda = _tensor_cuda  # type: ignore[method-assign,assignment]
        from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

        hybrid = hybrid_optimizer.HybridDeviceOptimizer
        hybrid._get_sub_optimizer_param_groups = _cpu_sub_optimizer_param_groups  # type: ignore[method-assign]
        hybrid._move_new_state_to_right_device = _cpu_move_new_state  # type: ignore[method-assign]
        from megatron.core.models.common.embeddings import rope_utils

        rope_utils._apply_rotary_pos_emb_thd = _rope_thd(rope_utils._apply_rotary_pos_emb_thd)
        _applied = True
    _patch_loaded_modules()
    return True
