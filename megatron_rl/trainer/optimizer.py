"""The trainer's optimizer: megatron-core's (distributed) Adam for a run, with optimizer CPU offload.

    optimizer = build_optimizer(run, ddp)     # get_megatron_optimizer with the run's settings, repaired below

Optimizer CPU offload (`trainer.optimizer.cpu_offload`) is megatron-core's HybridDeviceOptimizer: it keeps
`offload_fraction` of the distributed optimizer's shard (the first parameters, by elements) on the host, their
fp32 master copy, an fp32 gradient buffer and Adam's moments, updated by torch's CPU AdamW, with the new values
copied back to the device after each step. Megatron-LM's rule applies: the offloaded optimizer is the
precision-aware one (the optimizer, not the distributed optimizer's fp32 main parameters, keeps the master
weights).

megatron-core 0.19.2 assumes every parameter of a parameter group has the body's dtype. The FP32 LM head
(docs/recipe.md §3) does not, and `build_optimizer` closes the gaps that follow, on GPUs as on CPU:

1. The distributed optimizer hands its inner optimizer each group's fp32 parameters first, then the others,
   but indexes them (`model_param_group_index_map`) in gradient-buffer order, where the fp32 head comes last:
   with a bf16 body, saving a checkpoint fetched another parameter's Adam state for each one and failed on the
   shapes (and a load would have put state on the wrong parameters). The index is rebuilt in the inner
   optimizer's order.
2. With offload, megatron hands the shards to a fresh HybridDeviceOptimizer through torch's `add_param_group`,
   which refuses the shard of an fp32 parameter (a view of the parameter, not a leaf): those views are marked
   `retain_grad`, which torch accepts in place of a leaf (nothing reads them through autograd).
3. With offload, an fp32 parameter that stays on the device (offload_fraction < 1) got no gradient: the
   precision-aware optimizer leaves it in `decoupled_grad`, which the hybrid optimizer copies only to its host
   and fp32 copies, so the device Adam skipped the head. It is handed its gradient before each update.
4. With offload, loading a checkpoint looked up an fp32 copy for every parameter and raised a KeyError on the
   fp32 ones, which have none: only the parameters with a copy are refreshed.
5. With offload, the hybrid optimizer clones the parameters it offloads when it is built, and
   `reload_model_params()` (called after weights are loaded from a Hugging Face start or a model-only checkpoint)
   refreshes only the fp32 copies of low-precision parameters: the host copy of an fp32 parameter (every one of an
   fp32 model; the FP32 LM head of a bf16 one) kept the weights of the build, and the first step copied them back
   over the loaded ones (a policy started from a checkpoint was back to its random init at step 2; the same
   defect as Megatron-LM PR #5071 and Megatron-Bridge PR #4082). Every copy is refreshed from its parameter.
6. Resuming with torch's Adam (no Apex or Transformer Engine: CPU, and the offloaded share on GPUs) restored the
   step counts of Adam's bias correction from the optimizer as it was before the load: the dp-reshardable
   parameter state carries each `step` as a local, non-persistent value, copied over the saved count (which
   megatron keeps in the parameter groups), into one tensor every parameter shared, so that each update
   advanced it once per parameter. The first step after a resume then moved every weight by ~1.4x or ~0.7x of
   what the uninterrupted run did (its loss still matched; the next one did not). `restore_adam_steps` gives
   each parameter its own count, the saved one, after every load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def build_optimizer(run: Any, ddp: Any) -> Any:
    """megatron-core's optimizer for `run` (a RunConfig) over the DDP-wrapped model `ddp`, repaired (see above)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.trainer.model import DTYPES

    opt = run.trainer.optimizer
    config = OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.grad_clip,
        bf16=run.trainer.params_dtype == "bf16",
        params_dtype=DTYPES[run.trainer.params_dtype],
        use_distributed_optimizer=run.parallel.distributed_optimizer,
        **offload_settings(opt, torch.cuda.is_available()),
    )
    with building(opt.cpu_offload):
        optimizer = get_megatron_optimizer(config, [ddp])
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        _index_in_inner_order(inner)
    if opt.cpu_offload:
        repair(optimizer)
    return optimizer


HYPERPARAMETERS = ("max_lr", "min_lr", "weight_decay", "betas", "eps")
"""What `apply_hyperparameters` sets in every parameter group (the learning rate itself is set at every step)."""


def apply_hyperparameters(optimizer: Any, opt: Any) -> None:
    """The run's optimizer settings (`trainer.optimizer`, a resume may change them) into every parameter group, over
    the ones a checkpoint load restored."""
    values = dict(max_lr=opt.lr, min_lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.adam_beta1, opt.adam_beta2))
    values["eps"] = opt.adam_eps
    for group in optimizer.param_groups:
        group.update({key: value for key, value in values.items() if key in group})


def retarget_saved_groups(state: Any, opt: Any) -> None:
    """A saved optimizer state's parameter groups given the run's learning rate before it loads: megatron pairs saved
    and current groups by their settings (`max_lr` and `min_lr` among them), so a resume at another learning rate
    found no saved group for each current one (a KeyError inside megatron)."""
    if isinstance(state, dict):
        for key, value in state.items():
            if key == "param_groups" and isinstance(value, list):
                for group in value:
                    if isinstance(group, dict):
                        group.update({k: opt.lr for k in ("max_lr", "min_lr") if k in group})
            else:
                retarget_saved_groups(value, opt)
    elif isinstance(state, list):
        for value in state:
            retarget_saved_groups(value, opt)


def restore_adam_steps(optimizer: Any) -> int:
    """Gap 6: after a checkpoint load, each parameter's Adam step count set to the saved one (its parameter group's
    `step`), in a tensor of its own; returns how many states it set. Optimizers that keep the count in the group
    alone (Transformer Engine's and Apex's fused Adam) have no per-parameter `step` and are left as they are."""
    restored = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for group in torch_optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = torch_optimizer.state.get(param)
                if state and "step" in state:
                    old = state["step"]
                    state["step"] = torch.tensor(float(group["step"]), dtype=old.dtype, device=old.device)
                    restored += 1
        hybrid_sync = getattr(torch_optimizer, "_sync_hdo_state_to_sub_optimizers", None)
        if hybrid_sync is not None and restored:  # the offloaded optimizer's parts share these state dicts
            for sub in torch_optimizer.sub_optimizers:
                for param in list(sub.state):
                    original = torch_optimizer.inner_param_to_orig_param.get(param, param)
                    if original in torch_optimizer.state:
                        sub.state[param]["step"] = torch_optimizer.state[original]["step"]
    return restored


def _index_in_inner_order(distributed: Any) -> None:
    """Gap 1: each model parameter's (group, position) as the inner optimizer holds it, fp32 parameters first."""
    groups = getattr(distributed, "model_fp32_groups", None)
    if groups is None:  # not megatron's DistributedOptimizer
        return
    for index, (fp32, other) in enumerate(zip(groups, distributed.model_float16_groups, strict=True)):
        for position, param in enumerate([*fp32, *other]):
            distributed.model_param_group_index_map[param] = (index, position)


def offload_settings(opt: Any, cuda: bool) -> dict[str, Any]:
    """megatron-core's OptimizerConfig fields for `trainer.optimizer` (`opt`): none without offload. Host buffers
    are pinned and the copies overlap the update where there is a GPU to copy from."""
    if not opt.cpu_offload:
        return {}
    return dict(
        optimizer_cpu_offload=True,
        optimizer_offload_fraction=opt.offload_fraction,
        use_precision_aware_optimizer=True,
        overlap_cpu_optimizer_d2h_h2d=cuda,
        pin_cpu_grads=cuda,
        pin_cpu_params=cuda,
    )


@contextlib.contextmanager
def building(offload: bool) -> Iterator[None]:
    """The context to build the optimizer in: with offload, the HybridDeviceOptimizer megatron creates accepts the
    shards of fp32 parameters (gap 2)."""
    if not offload:
        yield
        return
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer

    original = hybrid_optimizer.HybridDeviceOptimizer.__init__

    def init(self: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        params = list(params)
        for group in params:
            for param in group["params"] if isinstance(group, dict) else [group]:
                if param.requires_grad and not param.is_leaf:
                    param.retain_grad()
        original(self, params, *args, **kwargs)

    hybrid_optimizer.HybridDeviceOptimizer.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        hybrid_optimizer.HybridDeviceOptimizer.__init__ = original  # type: ignore[method-assign]


def repair(optimizer: Any) -> int:
    """Close gaps 3 to 5 in every HybridDeviceOptimizer inside megatron's (chained) optimizer; returns how many it
    found."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    found = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        hybrid = getattr(inner, "optimizer", None)
        if isinstance(hybrid, HybridDeviceOptimizer):
            hybrid._set_sub_optimizer_grads = _with_device_fp32_grads(hybrid, hybrid._set_sub_optimizer_grads)
            hybrid._update_fp32_params_by_new_state = lambda hybrid=hybrid: _update_fp32_copies(hybrid)
            hybrid.update_fp32_param_by_new_param = lambda hybrid=hybrid: refresh_copies(hybrid)
            found += 1
    return found


def _with_device_fp32_grads(hybrid: Any, original: Any) -> Any:
    def set_grads() -> None:
        original()
        if hybrid.gpu_optimizer is None:
            return
        for group in hybrid.gpu_optimizer.param_groups:
            for param in group["params"]:
                if param not in hybrid.fp32_param_to_orig_param:  # the parameter itself, not a copy
                    param.grad = getattr(param, "decoupled_grad", None)

    return set_grads


def refresh_copies(hybrid: Any) -> None:
    """Every copy the hybrid optimizer keeps of a parameter (its fp32 copy, its host copy, or both in one) set to the
    parameter's current value (gap 5): what megatron's `update_fp32_param_by_new_param` does for fp32 copies only."""
    with torch.no_grad():
        for param, copy in hybrid.param_to_fp32_param.items():
            copy.copy_(param)
        for param, copy in hybrid.gpu_params_map_cpu_copy.items():
            if param not in hybrid.param_to_fp32_param:  # a host copy of an fp32 parameter
                copy.copy_(param)


def _update_fp32_copies(hybrid: Any) -> None:
    """megatron's `_update_fp32_params_by_new_state` for the parameters that have an fp32 copy (gap 4)."""
    if not hybrid.param_update_in_fp32:
        return
    for param, state in hybrid.state.items():
        copy = hybrid.param_to_fp32_param.get(param)
        if copy is not None and "master_param" in state:
            copy.data.copy_(state["master_param"])
