"""A Transformer Engine stand-in: megatron-core's TE layer spec, built and run where TE is not installed (CPU hosts,
login nodes), with every call megatron makes into TE recorded and checked against TE's own signatures and rules.

    from megatron_rl.trainer import te_standin
    te_standin.install()        # before megatron-core is imported in this process (a fresh process)
    ... build_model(...) with trainer.layer_spec=transformer_engine ...
    te_standin.CALLS            # [Call(cls, method, arguments)], every TE constructor and forward megatron called

GPU nodes run Transformer Engine itself; this module exists so that the configuration a GPU node builds is built
before the cluster is booked (`megatron-rl check` and `plan`, trainer/te_check.py) and so that the CPU tests run
megatron's TE wiring (fused norm+linear weights, THD attention arguments, grouped expert GEMMs, Llama-4's rules
around TE's attention) with the same numbers as the local spec.

What it models (transformer_engine.pytorch.*), with the real math in torch:

    Linear, LayerNormLinear, GroupedLinear   weights as TE shards them (column: out/tp, row: in/tp); TE's own
                                             tensor-parallel communication (sequence-parallel all-gather before a
                                             column GEMM, reduce-scatter or all-reduce after a row GEMM) through
                                             megatron's autograd-aware collectives
    RMSNorm, LayerNorm                       weight (and bias), eps, zero-centred gamma
    DotProductAttention                      THD (packed) causal attention per segment of cu_seqlens, GQA, and
                                             TE's THD context parallelism (cp_comm_type p2p; the exchange
                                             modelled by trainer/context_parallel.py's all-gather)

Every constructor and forward call is checked against the signatures of the TE release the GPU image pins
(te_signatures.json, read from that release's sources by tools/te_signatures.py: unknown or missing arguments
are refused) and, for attention, against the rules TE's `DotProductAttention.forward` asserts for the THD
format (transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py): 3-D q/k/v of one
dtype, a "padding" mask type, cu_seqlens_q/kv 1-D int32 of equal shape on the tensors' device, head dims and
GQA groups per partition as constructed; and int max_seqlen (TE declares `int`; a tensor costs a device sync).
Anything else megatron reaches in TE (FP8 recipes, fused RoPE, fused permutation, CPU offload, ...) is a class
that refuses to be instantiated or called, naming what megatron asked for; TE's fused optimizers are absent, so
megatron falls back to torch's AdamW as it does without TE.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import math
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

SIGNATURES: dict[str, Any] = json.loads((Path(__file__).with_name("te_signatures.json")).read_text())
VERSION: str = SIGNATURES["version"]
ABSENT = ("transformer_engine.pytorch.optimizers",)
"""TE submodules the stand-in does not provide: megatron imports them in try/except and falls back."""
NORM_OP_KWARGS = {"device", "dtype", "sm_margin"}
"""What TE's RMSNorm/LayerNorm pass on through **kwargs to their fusible operation (te.pytorch.ops)."""


class TEStandinError(RuntimeError):
    """megatron called Transformer Engine in a way TE would refuse, or reached a part the stand-in does not model."""


@dataclass
class Call:
    cls: str
    method: str
    arguments: dict[str, Any] = field(default_factory=dict)


CALLS: list[Call] = []


def _summary(value: Any) -> Any:
    if isinstance(value, Tensor):
        return {"shape": tuple(value.shape), "dtype": str(value.dtype), "device": value.device.type}
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    return type(value).__name__


def _checked(cls: str, method: str, arguments: dict[str, Any]) -> None:
    """Record a call and refuse what TE's signature does not accept."""
    CALLS.append(Call(cls, method, {k: _summary(v) for k, v in arguments.items()}))
    spec = SIGNATURES[cls].get(method)
    if spec is None:
        return
    known = set(spec["positional"]) | set(spec["keyword_only"])
    extra = NORM_OP_KWARGS if spec["var_keyword"] else set()
    unknown = sorted(set(arguments) - known - extra)
    missing = sorted(set(spec["required"]) - set(arguments))
    if unknown or missing:
        raise TEStandinError(
            f"transformer_engine.pytorch.{cls}.{method}: "
            + "; ".join(
                part
                for part in (
                    f"unexpected arguments {unknown}" if unknown else "",
                    f"missing arguments {missing}" if missing else "",
                )
                if part
            )
            + f" (Transformer Engine {VERSION}, {SIGNATURES[cls]['source']})"
        )


def _refuse(cls: str, rule: str) -> None:
    source = SIGNATURES[cls]["source"]
    raise TEStandinError(f"transformer_engine.pytorch.{cls}: {rule} (Transformer Engine {VERSION}, {source})")


# --------------------------------------------------------------------------------------------------
# Modelled classes


def _device(kwargs: dict[str, Any]) -> torch.device:
    """Where TE would allocate: the explicit device, CPU for a CUDA device on a host without CUDA, and the meta
    device whenever the caller builds under `torch.device("meta")` (the memory plan)."""
    ambient = torch.get_default_device()
    if ambient.type == "meta":
        return ambient
    device = kwargs.get("device")
    if device is None or isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class _ParallelLinearBase(torch.nn.Module):
    """What TE's Linear, LayerNormLinear and GroupedLinear share: TE's sharding rule and its TP communication."""

    def _setup(self, in_features: int, out_features: int, kwargs: dict[str, Any]) -> None:
        from megatron.core.tensor_parallel.utils import divide

        self.parallel_mode = kwargs.get("parallel_mode")
        if self.parallel_mode not in (None, "column", "row", "duplicated"):
            _refuse(type(self).__name__, f"parallel_mode {self.parallel_mode!r}")
        self.tp_group = kwargs.get("tp_group")
        self.tp_size = int(kwargs.get("tp_size") or 1)
        self.tp_rank = torch.distributed.get_rank(self.tp_group) if self.tp_group is not None else 0
        self.sequence_parallel = bool(kwargs.get("sequence_parallel")) and self.tp_size > 1
        self.in_features = divide(in_features, self.tp_size) if self.parallel_mode == "row" else in_features
        self.out_features = divide(out_features, self.tp_size) if self.parallel_mode == "column" else out_features
        self.use_bias = bool(kwargs.get("bias", True))
        self.return_bias = bool(kwargs.get("return_bias", False))
        self.params_dtype = kwargs.get("params_dtype") or torch.get_default_dtype()
        if self.params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            _refuse(type(self).__name__, f"params_dtype {self.params_dtype}")
        self.fuse_wgrad_accumulation = bool(kwargs.get("fuse_wgrad_accumulation"))
        self.device_ = _device(kwargs)

    def _parameter(self, *shape: int, init: Any = None, tp: bool = True, dim: int = 0) -> torch.nn.Parameter:
        param = torch.nn.Parameter(torch.empty(*shape, dtype=self.params_dtype, device=self.device_))
        if init is not None and param.device.type != "meta":
            init(param)
        if tp and self.parallel_mode in ("column", "row") and self.tp_size > 1:
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(param, True, dim, 1)
        return param

    def _input(self, inp: Tensor) -> Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.parallel_mode != "column" or self.tp_size == 1:
            return inp
        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(inp, True, group=self.tp_group)
        return mappings.copy_to_tensor_model_parallel_region(inp, group=self.tp_group)

    def _output(self, out: Tensor) -> Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.parallel_mode != "row" or self.tp_size == 1:
            return out
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        return mappings.reduce_from_tensor_model_parallel_region(out, group=self.tp_group)

    def _result(self, out: Tensor, bias: Tensor | None) -> Any:
        if self.return_bias:
            return out, (bias if bias is not None else out.new_zeros(0))
        return out if bias is None else out + bias


class Linear(_ParallelLinearBase):
    def __init__(self, in_features: int, out_features: int, **kwargs: Any) -> None:
        _checked("Linear", "__init__", {"in_features": in_features, "out_features": out_features, **kwargs})
        super().__init__()
        self._setup(in_features, out_features, kwargs)
        init = kwargs.get("init_method")
        self.weight = self._parameter(self.out_features, self.in_features, init=init, dim=self._dim())
        self.bias = self._parameter(self.out_features, tp=self.parallel_mode == "column") if self.use_bias else None
        if self.bias is not None and self.bias.device.type != "meta":
            torch.nn.init.zeros_(self.bias)

    def _dim(self) -> int:
        return 1 if self.parallel_mode == "row" else 0

    def forward(self, inp: Tensor, is_first_microbatch: bool | None = None, **kwargs: Any) -> Any:
        _checked("Linear", "forward", {"inp": inp, "is_first_microbatch": is_first_microbatch, **kwargs})
        return self._result(self._output(F.linear(self._input(inp), self.weight)), self.bias)


def _norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, kind: str, zero_centered: bool) -> Tensor:
    gamma = weight + 1 if zero_centered else weight
    x32 = x.float()
    if kind == "RMSNorm":
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = F.layer_norm(x32, x32.shape[-1:], eps=eps)
    y = y * gamma.float() + (bias.float() if bias is not None else 0.0)
    return y.to(x.dtype)


class LayerNormLinear(_ParallelLinearBase):
    def __init__(self, in_features: int, out_features: int, **kwargs: Any) -> None:
        _checked("LayerNormLinear", "__init__", {"in_features": in_features, "out_features": out_features, **kwargs})
        super().__init__()
        self._setup(in_features, out_features, kwargs)
        if self.parallel_mode not in (None, "column"):
            _refuse("LayerNormLinear", f"parallel_mode {self.parallel_mode!r}: column or None")
        self.eps = float(kwargs.get("eps", 1e-5))
        self.normalization = kwargs.get("normalization", "LayerNorm")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            _refuse("LayerNormLinear", f"normalization {self.normalization!r}")
        self.zero_centered_gamma = bool(kwargs.get("zero_centered_gamma"))
        self.return_layernorm_output = bool(kwargs.get("return_layernorm_output"))
        self.layer_norm_weight = self._parameter(in_features, tp=False)
        if self.layer_norm_weight.device.type != "meta":
            torch.nn.init.zeros_(self.layer_norm_weight) if self.zero_centered_gamma else torch.nn.init.ones_(
                self.layer_norm_weight
            )
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
        self.layer_norm_bias = None
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = self._parameter(in_features, tp=False)
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
        init = kwargs.get("init_method")
        self.weight = self._parameter(self.out_features, in_features, init=init)
        self.bias = self._parameter(self.out_features) if self.use_bias else None
        if self.bias is not None and self.bias.device.type != "meta":
            torch.nn.init.zeros_(self.bias)

    def forward(self, inp: Tensor, is_first_microbatch: bool | None = None, **kwargs: Any) -> Any:
        _checked("LayerNormLinear", "forward", {"inp": inp, "is_first_microbatch": is_first_microbatch, **kwargs})
        normed = _norm(
            inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization, self.zero_centered_gamma
        )
        out = F.linear(self._input(normed), self.weight)
        result = self._result(out, self.bias)
        if self.return_layernorm_output:
            return (*result, normed) if isinstance(result, tuple) else (result, normed)
        return result


class GroupedLinear(_ParallelLinearBase):
    def __init__(self, num_gemms: int, in_features: int, out_features: int, **kwargs: Any) -> None:
        arguments = {"num_gemms": num_gemms, "in_features": in_features, "out_features": out_features, **kwargs}
        _checked("GroupedLinear", "__init__", arguments)
        super().__init__()
        self._setup(in_features, out_features, kwargs)
        self.num_gemms = num_gemms
        init = kwargs.get("init_method")
        dim = 1 if self.parallel_mode == "row" else 0
        for i in range(num_gemms):
            setattr(self, f"weight{i}", self._parameter(self.out_features, self.in_features, init=init, dim=dim))
            if self.use_bias:
                setattr(self, f"bias{i}", self._parameter(self.out_features, tp=self.parallel_mode == "column"))
                if getattr(self, f"bias{i}").device.type != "meta":
                    torch.nn.init.zeros_(getattr(self, f"bias{i}"))

    def forward(self, inp: Tensor, m_splits: list[int], is_first_microbatch: bool | None = None, **kwargs: Any) -> Any:
        arguments = {"inp": inp, "m_splits": m_splits, "is_first_microbatch": is_first_microbatch, **kwargs}
        _checked("GroupedLinear", "forward", arguments)
        if len(m_splits) != self.num_gemms:
            _refuse("GroupedLinear", f"{len(m_splits)} m_splits for {self.num_gemms} GEMMs")
        if not all(isinstance(m, int) for m in m_splits):
            _refuse("GroupedLinear", "m_splits must be a list of Python ints")
        x = self._input(inp)
        parts = torch.split(x, m_splits, dim=0)
        outs = [F.linear(part, getattr(self, f"weight{i}")) for i, part in enumerate(parts)]
        out = self._output(torch.cat(outs, dim=0))
        if not self.use_bias:
            return self._result(out, None)
        bias = torch.cat([getattr(self, f"bias{i}").expand(m, -1) for i, m in enumerate(m_splits)], dim=0)
        if self.return_bias:
            return out, bias
        return out + bias


class _NormBase(torch.nn.Module):
    kind = ""

    def __init__(self, normalized_shape: Any = None, eps: float = 1e-5, **kwargs: Any) -> None:
        _checked(self.kind, "__init__", {"normalized_shape": normalized_shape, "eps": eps, **kwargs})
        super().__init__()
        hidden = kwargs.get("hidden_size") or normalized_shape
        hidden = hidden if isinstance(hidden, int) else int(math.prod(hidden))
        dtype = kwargs.get("params_dtype") or kwargs.get("dtype") or torch.get_default_dtype()
        self.eps, self.zero_centered_gamma = eps, bool(kwargs.get("zero_centered_gamma"))
        device = _device(kwargs)
        self.weight = torch.nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))
        self.bias = (
            torch.nn.Parameter(torch.empty(hidden, dtype=dtype, device=device)) if self.kind == "LayerNorm" else None
        )
        if device.type != "meta":
            torch.nn.init.zeros_(self.weight) if self.zero_centered_gamma else torch.nn.init.ones_(self.weight)
            if self.bias is not None:
                torch.nn.init.zeros_(self.bias)
        for param in self.parameters():
            param.sequence_parallel = bool(kwargs.get("sequence_parallel"))  # type: ignore[attr-defined]

    def forward(self, inp: Tensor) -> Tensor:
        CALLS.append(Call(self.kind, "forward", {"input": _summary(inp)}))
        return _norm(inp, self.weight, self.bias, self.eps, self.kind, self.zero_centered_gamma)


class RMSNorm(_NormBase):
    kind = "RMSNorm"


class LayerNorm(_NormBase):
    kind = "LayerNorm"


ATTN_MASK_TYPES = (
    "no_mask", "padding", "causal", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right", "arbitrary",
)  # fmt: skip
"""transformer_engine/pytorch/attention/dot_product_attention/utils.py AttnMaskTypes (2.18)."""


class DotProductAttention(torch.nn.Module):
    def __init__(self, num_attention_heads: int, kv_channels: Any, **kwargs: Any) -> None:
        arguments = {"num_attention_heads": num_attention_heads, "kv_channels": kv_channels, **kwargs}
        _checked("DotProductAttention", "__init__", arguments)
        super().__init__()
        tp = int(kwargs.get("tp_size") or 1)
        groups = kwargs.get("num_gqa_groups") or num_attention_heads
        k_channels, v_channels = kv_channels if isinstance(kv_channels, tuple) else (kv_channels, kv_channels)
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = k_channels, v_channels
        self.num_attention_heads_per_partition = num_attention_heads // tp
        self.num_gqa_groups_per_partition = groups // tp
        self.qkv_format = kwargs.get("qkv_format", "sbhd")
        self.attn_mask_type = kwargs.get("attn_mask_type", "causal")
        self.softmax_scale = kwargs.get("softmax_scale") or 1.0 / math.sqrt(k_channels)
        if kwargs.get("attention_dropout"):
            _refuse("DotProductAttention", "attention dropout is not modelled by the stand-in")
        self.cp_group = None
        self.set_context_parallel_group(kwargs.get("cp_group"), None, None, kwargs.get("cp_comm_type", "p2p"))

    def set_context_parallel_group(self, cp_group: Any, *args: Any, **kwargs: Any) -> None:
        """TE's context parallelism for THD: the rank's share of every segment (2 x cp chunks, its r and 2cp-1-r),
        keys and values exchanged over the group (modelled by an all-gather, trainer/context_parallel.py)."""
        comm = kwargs.get("cp_comm_type", args[2] if len(args) > 2 else "p2p")
        if cp_group is not None and torch.distributed.get_world_size(cp_group) > 1:
            if comm != "p2p":
                _refuse("DotProductAttention", f"cp_comm_type {comm!r}: the stand-in models p2p (TE's THD default)")
            self.cp_group = cp_group

    def forward(self, query_layer: Tensor, key_layer: Tensor, value_layer: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        names = SIGNATURES["DotProductAttention"]["forward"]["positional"][3:]
        arguments = {"query_layer": query_layer, "key_layer": key_layer, "value_layer": value_layer}
        arguments.update(dict(zip(names, args, strict=False)), **kwargs)
        _checked("DotProductAttention", "forward", arguments)
        qkv_format = arguments.get("qkv_format") or self.qkv_format
        mask = (arguments.get("attn_mask_type") or self.attn_mask_type).replace(",", "_")
        if mask not in ATTN_MASK_TYPES:
            _refuse("DotProductAttention", f"attn_mask_type {mask!r}")
        if qkv_format != "thd":
            _refuse("DotProductAttention", f"qkv_format {qkv_format!r}: the stand-in models THD (packed rows) only")
        q, k, v = query_layer, key_layer, value_layer
        if not (q.dtype == k.dtype == v.dtype):
            _refuse("DotProductAttention", "queries, keys and values must have the same data type")
        if not all(x.dim() == 3 for x in (q, k, v)):
            _refuse("DotProductAttention", "queries, keys and values must be 3D tensors when qkv_format = thd")
        if "padding" not in mask:
            _refuse("DotProductAttention", f"attn_mask_type {mask!r}: must be padding or padding_causal for thd")
        if q.shape[-1] != self.hidden_size_per_attention_head_k or v.shape[-1] != self.hidden_size_per_attention_head_v:
            _refuse("DotProductAttention", f"head dims {q.shape[-1]}/{v.shape[-1]} differ from the constructed ones")
        if k.shape[-2] != self.num_gqa_groups_per_partition:
            _refuse("DotProductAttention", f"{k.shape[-2]} key heads, constructed {self.num_gqa_groups_per_partition}")
        cu_q, cu_kv = arguments.get("cu_seqlens_q"), arguments.get("cu_seqlens_kv")
        if cu_q is None or cu_kv is None:
            _refuse("DotProductAttention", "cu_seqlens_q and cu_seqlens_kv can not be None when qkv_format = thd")
        if cu_q.dim() != 1 or cu_q.shape != cu_kv.shape:
            _refuse("DotProductAttention", "cu_seqlens_q and cu_seqlens_kv must both have shape [batch_size + 1]")
        if cu_q.dtype != torch.int32 or cu_kv.dtype != torch.int32:
            _refuse("DotProductAttention", f"cu_seqlens must be torch.int32, got {cu_q.dtype}/{cu_kv.dtype}")
        if cu_q.device != q.device or cu_kv.device != q.device:
            _refuse("DotProductAttention", f"cu_seqlens on {cu_q.device}, queries on {q.device}")
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            value = arguments.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                _refuse("DotProductAttention", f"{name} must be a Python int, got {type(value).__name__}")
        bounds = cu_q.tolist()
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            value = arguments.get(name)
            if value is not None and value < longest:
                _refuse("DotProductAttention", f"{name} {value} below the longest segment of cu_seqlens ({longest})")
        if self.cp_group is not None:
            return self._context_parallel(q, k, v, arguments, mask)
        repeat = q.shape[1] // k.shape[1]
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        causal = "causal" in mask
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end > start:
                qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=self.softmax_scale)
                outputs.append(out[0])
        return torch.cat(outputs, dim=1).transpose(0, 1).reshape(q.shape[0], -1)

    def _context_parallel(self, q: Tensor, k: Tensor, v: Tensor, arguments: dict[str, Any], mask: str) -> Tensor:
        """TE's THD rules under context parallelism: cu_seqlens (padded ones where given) describe the whole row,
        every segment a multiple of 2 x cp tokens, and this rank holds row tokens / cp of them."""
        from megatron_rl.trainer.context_parallel import attend, cp_layout

        cp, rank = torch.distributed.get_world_size(self.cp_group), torch.distributed.get_rank(self.cp_group)
        padded = arguments.get("cu_seqlens_q_padded")
        bounds = (padded if padded is not None else arguments["cu_seqlens_q"]).tolist()
        segments = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        if any(n % (2 * cp) for n in segments):
            _refuse("DotProductAttention", f"THD with context parallelism: segments {segments} not multiples of 2 x cp")
        if bounds[-1] != q.shape[0] * cp:
            _refuse("DotProductAttention", f"{q.shape[0]} local tokens for a row of {bounds[-1]} at cp {cp}")
        if "causal" not in mask:
            _refuse("DotProductAttention", f"attn_mask_type {mask!r}: the stand-in models causal context parallelism")
        layout = cp_layout(segments, cp, rank)
        return attend(q, k, v, layout, self.softmax_scale, False, self.cp_group)


def get_cpu_offload_context(enabled: bool = False, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """transformer_engine.pytorch.cpu_offload.get_cpu_offload_context: megatron asks for it on every build; off,
    TE returns a null context and an identity (cpu_offload.py)."""
    CALLS.append(Call("cpu_offload", "get_cpu_offload_context", {"enabled": enabled}))
    if enabled:
        raise TEStandinError("transformer_engine.pytorch.cpu_offload: activation offloading is not modelled")
    return contextlib.nullcontext(), lambda x: x


class _SplitAlongDim:
    """transformer_engine.pytorch.attention._SplitAlongDim: megatron splits the fused QKV projection with it (a
    split whose backward avoids a copy when the pieces are adjacent); the same values as torch.split."""

    @staticmethod
    def apply(tensor: Tensor, dim: int, sizes: list[int]) -> tuple[Tensor, ...]:
        return torch.split(tensor, sizes, dim=dim)


def general_gemm(A: Tensor, B: Tensor, out_dtype: torch.dtype | None = None, layout: str = "TN", **kwargs: Any) -> list:
    """transformer_engine.pytorch.cpp_extensions.general_gemm (cuBLAS, column-major): in row-major terms
    out = op_B(B) @ op_A(A), "T" transposing; megatron's MoE router computes its fp32 logits with it (bf16 products
    are exact in fp32, so casting the inputs first gives the same sums up to accumulation order)."""
    CALLS.append(Call("cpp_extensions", "general_gemm", {"A": _summary(A), "B": _summary(B), "layout": layout}))
    if layout not in ("TN", "NN", "NT"):
        raise TEStandinError(f"transformer_engine general_gemm: layout {layout!r} not supported")
    if kwargs.get("quantization_params") is not None or kwargs.get("gelu") or kwargs.get("accumulate"):
        raise TEStandinError(
            "transformer_engine general_gemm: quantized, GELU-fused or accumulating GEMMs are not modelled"
        )
    dtype = out_dtype or A.dtype
    a = A.to(dtype).t() if layout[0] == "T" else A.to(dtype)
    b = B.to(dtype).t() if layout[1] == "T" else B.to(dtype)
    out = b @ a
    if kwargs.get("bias") is not None:
        out = out + kwargs["bias"].to(dtype)
    return [out, None, None, None]


def get_workspace() -> Tensor:
    """transformer_engine.pytorch.module.base.get_workspace: cuBLAS's scratch buffer (unused here)."""
    return torch.empty(0)


MODELLED: dict[str, Any] = {
    "transformer_engine.pytorch.cpp_extensions": {"general_gemm": general_gemm},
    "transformer_engine.pytorch.module.base": {"get_workspace": get_workspace},
    "transformer_engine.pytorch.attention": {"_SplitAlongDim": _SplitAlongDim},
    "transformer_engine.pytorch.cpu_offload": {"get_cpu_offload_context": get_cpu_offload_context},
    "transformer_engine.pytorch": {
        "Linear": Linear,
        "LayerNormLinear": LayerNormLinear,
        "GroupedLinear": GroupedLinear,
        "RMSNorm": RMSNorm,
        "LayerNorm": LayerNorm,
        "DotProductAttention": DotProductAttention,
    },
}


# --------------------------------------------------------------------------------------------------
# The package


class _UnmodelledMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _unmodelled(f"{cls._te_name}.{name}")


class _Unmodelled(metaclass=_UnmodelledMeta):
    _te_name = "transformer_engine"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TEStandinError(
            f"megatron-core called {self._te_name}, which the Transformer Engine stand-in does not model; "
            "turn off the setting that uses it, or check on a node with Transformer Engine"
        )


def _unmodelled(name: str) -> type:
    return _UnmodelledMeta(name.rsplit(".", 1)[-1], (_Unmodelled,), {"_te_name": name})


class _Package(types.ModuleType):
    """A transformer_engine (sub)module: modelled names, submodules, anything else an unmodelled class."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        if full in sys.modules:
            return sys.modules[full]
        value = _unmodelled(full)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "transformer_engine" and not fullname.startswith("transformer_engine."):
            return None
        if any(fullname == absent or fullname.startswith(absent + ".") for absent in ABSENT):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Package(spec.name)
        module.__path__ = []  # a package: submodules import
        for name, value in MODELLED.get(spec.name, {}).items():
            setattr(module, name, value)
        if spec.name == "transformer_engine":
            module.__version__ = VERSION
            module.STANDIN = True
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        parent, _, child = module.__name__.rpartition(".")
        if parent and parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def install() -> None:
    """Make `import transformer_engine` give the stand-in in this process. Must run before megatron-core imports
    it (megatron decides at import whether TE is there): refuses when megatron's TE extension is already loaded,
    or when a real Transformer Engine is importable (a GPU node runs TE itself)."""
    if active():
        return
    if "megatron.core.extensions.transformer_engine" in sys.modules:
        raise RuntimeError("te_standin.install(): megatron-core was imported first in this process")
    if importlib.util.find_spec("transformer_engine") is not None:
        raise RuntimeError("te_standin.install(): Transformer Engine is installed here; use it")
    sys.meta_path.insert(0, _Finder())


def active() -> bool:
    """Whether `transformer_engine` in this process is the stand-in."""
    module = sys.modules.get("transformer_engine")
    if module is not None:
        return bool(getattr(module, "STANDIN", False))
    return any(isinstance(finder, _Finder) for finder in sys.meta_path)
