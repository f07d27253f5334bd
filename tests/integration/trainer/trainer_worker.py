"""A trainer rank for the multi-process trainer tests (tests/integration/trainer/test_trainer.py launches it).

    python tests/integration/trainer/trainer_worker.py SPEC_JSON

SPEC: {"model": ..., "overrides": [...], "load": ckpt or null, "save": ckpt root or null,
       "steps": n, "out": file, "batch": fixed_batch() arguments, "hf": HF dir to load, "push": bool,
       "routing": seed of random generator routing records (MoE),
      "cp_partition": "contiguous" to split rows over CP ranks wrongly, ...}.
Every rank writes its results to `out.rank<r>`: log-probs of a fixed batch before training, its packed rows,
then the loss and grad norm of each step; on request ("grads", "record_collectives", "record_checkpoints")
the gradients of one step ("grads_step", default the last), what each collective received, and megatron's
activation checkpoints per phase;
with "te_standin", Transformer Engine's layer spec through trainer/te_standin.py and every call it recorded.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch


def fixed_batch(
    seed: int = 0,
    prompts: int = 4,
    group: int = 4,
    vocab: int = 500,
    prompt_len: tuple[int, int] = (3, 9),
    completion_len: tuple[int, int] = (2, 12),
) -> list:
    """Groups of random tokens; lengths drawn from [low, high) (prompt per group, completion per sample), one masked
    (injected) token per completion."""
    from megatron_rl.rollout.types import random_groups

    return random_groups(seed, prompts, group, vocab, tuple(prompt_len), tuple(completion_len), masked_index=1)


def add_environment_segments(batch: list, vocab: int, perturb: str | None) -> None:
    """Gives every completion two environment segments as a tool-using trajectory has: tokens 2-4 (a tool's response
    between policy turns) and 3 tokens appended at the end, all out of the loss. `perturb`: "environment" changes
    what the trainer could read of them besides their place (their generator log-probs and versions, and the
    appended ones' ids); "policy" changes the generator log-prob of one policy token instead (a control)."""
    import random

    rng = random.Random(7)
    for group in batch:
        for c in group.completions:
            c.tokens += [rng.randrange(5, vocab) for _ in range(3)]
            c.gen_logprobs += [-6.0] * 3
            c.versions += [0] * 3
            c.loss_mask += [False] * 3
            env = [i for i in range(2, 5) if i < len(c.tokens) - 3] + list(range(len(c.tokens) - 3, len(c.tokens)))
            for i in env:
                c.loss_mask[i] = False
            if perturb == "environment":
                for i in env:
                    c.gen_logprobs[i] += 2.5
                    c.versions[i] += 1
                c.tokens[-3:] = [(t + 17) % (vocab - 5) + 5 for t in c.tokens[-3:]]
            elif perturb == "policy":
                c.gen_logprobs[0] += 0.5


def attach_random_routing(batch: list, model: Any, seed: int) -> None:
    """Give every completion a generator routing record of distinct random experts per token and layer."""
    import numpy as np

    from megatron_rl.rollout.types import RoutingShape

    shape = RoutingShape(model.num_layers, model.moe.router_topk, model.moe.num_experts)
    rng = np.random.default_rng(seed)
    for group in batch:
        for c in group.completions:
            rows = len(c.prompt_tokens) + len(c.tokens) - 1
            draws = rng.random((rows, shape.layers, shape.experts))
            c.routed_experts = np.argsort(draws, axis=-1)[..., : shape.topk].astype(shape.dtype)


COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
    "send", "recv", "isend", "irecv", "reduce_scatter", "all_to_all", "_all_gather_base", "_reduce_scatter_base",
)  # fmt: skip


def _record_collectives() -> dict[str, Any]:
    """Wrap torch.distributed's collectives (megatron's calls included) and its group constructors.

    Returns {"calls": {(collective, group backend, device type) of every tensor a collective received},
    "default": the default group's backend}. The group backend is the one its constructor declared, or
    "default" for a group that inherits the default group's (new_group's backend=None, or group=None)."""
    import inspect

    import torch.distributed as dist

    record: dict[str, Any] = {"calls": set(), "default": None}
    declared: dict[int, tuple[Any, str]] = {}  # id(group) -> (group, its constructor's backend)

    def backend_of(group: Any) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "default"
        known = declared.get(id(group))
        assert known is not None and known[0] is group, f"a collective on a group not made by new_group: {group}"
        return known[1]

    def tensors(value: Any) -> Iterator[torch.Tensor]:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from tensors(item)

    def wrap(name: str, fn: Any) -> Any:
        signature = inspect.signature(fn)

        def collective(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            backend = backend_of(bound.get("group"))
            for tensor in tensors(list(args) + list(kwargs.values())):
                record["calls"].add((name, backend, tensor.device.type))
            return fn(*args, **kwargs)

        return collective

    def new_group(fn: Any) -> Any:
        signature = inspect.signature(fn)

        def make(*args: Any, **kwargs: Any) -> Any:
            backend = signature.bind(*args, **kwargs).arguments.get("backend")
            group = fn(*args, **kwargs)
            declared[id(group)] = (group, "default" if backend is None else str(backend))
            return group

        return make

    def init_process_group(fn: Any) -> Any:
        signature = inspect.signature(fn)

        def init(*args: Any, **kwargs: Any) -> Any:
            record["default"] = signature.bind(*args, **kwargs).arguments.get("backend")
            return fn(*args, **kwargs)

        return init

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    dist.new_group = new_group(dist.new_group)
    dist.init_process_group = init_process_group(dist.init_process_group)
    p2p_op = dist.P2POp.__init__
    p2p_signature = inspect.signature(p2p_op)

    def p2p_init(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = p2p_signature.bind(self, *args, **kwargs).arguments
        record["calls"].add(("batch_isend_irecv", backend_of(bound.get("group")), bound["tensor"].device.type))
        p2p_op(self, *args, **kwargs)

    dist.P2POp.__init__ = p2p_init
    return record


def _record_checkpoints() -> dict[str, Counter]:
    """Wrap megatron's activation checkpoint (every recompute path goes through `CheckpointFunction`) and count
    its forwards and its backwards (the recompute) by the function that checkpointed, e.g.
    "Attention._checkpointed_attention_forward" or "checkpointed_forward.<locals>.chunk_runner"."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    counts: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}
    forward, backward = CheckpointFunction.forward, CheckpointFunction.backward
    inside = ("torch/autograd/", "megatron/core/tensor_parallel/random.py")

    def caller() -> str:
        frame = sys._getframe(2)
        while frame is not None and any(part in frame.f_code.co_filename for part in inside):
            frame = frame.f_back
        return frame.f_code.co_qualname if frame is not None else "?"

    def checkpointed_forward(ctx: Any, *args: Any) -> Any:
        ctx.checkpointed_by = caller()
        counts["forward"][ctx.checkpointed_by] += 1
        return forward(ctx, *args)

    def recomputed_backward(ctx: Any, *grads: Any) -> Any:
        counts["backward"][ctx.checkpointed_by] += 1
        return backward(ctx, *grads)

    CheckpointFunction.forward = staticmethod(checkpointed_forward)
    CheckpointFunction.backward = staticmethod(recomputed_backward)
    return counts


def _take(counts: dict[str, Counter]) -> dict[str, dict[str, int]]:
    taken = {k: dict(v) for k, v in counts.items()}
    for count in counts.values():
        count.clear()
    return taken


def main(spec: dict) -> None:
    if spec.get("te_standin"):  # Transformer Engine's spec through the stand-in: before megatron-core is imported
        from megatron_rl.trainer import te_standin

        te_standin.install()
    from megatron_rl.config import load_config
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.step import Trainer, sequences_from_groups

    if spec.get("cp_partition") == "contiguous":  # a deliberately wrong CP partition: rank r holds the r-th 1/cp
        from megatron_rl.trainer import context_parallel

        def contiguous(segments: list[int], cp: int, rank: int) -> list[tuple[int, int]]:
            starts = [sum(segments[:i]) for i in range(len(segments))]
            return [(a + rank * n // cp, a + (rank + 1) * n // cp) for a, n in zip(starts, segments, strict=True)]

        context_parallel.partition = contiguous
    torch.set_num_threads(1)
    collectives = _record_collectives() if spec.get("record_collectives") else None
    checkpoints = _record_checkpoints() if spec.get("record_checkpoints") else None
    run = load_config(spec.get("recipe", "scalerl-cpu"), spec["model"], spec.get("overrides", []))
    trainer = Trainer(run)
    if spec.get("hf"):
        from pathlib import Path

        from megatron_rl.convert import load_hf_into_model

        load_hf_into_model(trainer.model, run.model, Path(spec["hf"]))
        trainer.optimizer.reload_model_params()
    if spec.get("load"):
        load_checkpoint(trainer, spec["load"], model_only=spec.get("model_only", False))
    batch = fixed_batch(vocab=run.model.vocab_size, **spec.get("batch", {}))
    if "environment" in spec:  # tool responses in every completion, perturbed or not (add_environment_segments)
        add_environment_segments(batch, run.model.vocab_size, spec["environment"])
    if spec.get("routing") is not None:  # MoE: random generator routing records (seed) on every completion
        attach_random_routing(batch, run.model, spec["routing"])
    if spec.get("dump_batch") and torch.distributed.get_rank() == 0:
        torch.save(batch, spec["dump_batch"])
    push = None
    if spec.get("push"):  # the weight sync's stream: rank 0 receives it in the engines' dtype, the others nothing
        from megatron_rl.trainer.weights import iter_hf_weights

        pushed = {
            n: t.clone() for b in iter_hf_weights(trainer.model, run.model, 1 << 16, torch.bfloat16) for n, t in b
        }
        everywhere = {n: t.clone() for b in iter_hf_weights(trainer.model, run.model, 1 << 16, dst=None) for n, t in b}
        push = {
            "names": sorted(pushed),
            "dtypes": sorted({str(t.dtype) for t in pushed.values()}),
            "full_dtypes": {n: str(t.dtype) for n, t in everywhere.items()},
            "rounded": all(torch.equal(pushed[n], everywhere[n].to(torch.bfloat16)) for n in pushed),
        }
    result: dict = {"logprobs": trainer.compute_logprobs(batch), "steps": [], "checkpoints": [], "push": push}
    result["routing_agreement"] = getattr(trainer, "last_routing_agreement", {})
    if checkpoints is not None:  # [log-probs, step 1, ...]: {"forward"/"backward": {checkpointed by: count}}
        result["checkpoints"].append(_take(checkpoints))
    micro_batches = trainer._micro_batches(sequences_from_groups(batch, run))
    result["micro_batches"] = [len(mb.sequences) for mb in micro_batches]
    result["rows"] = [(sum(len(s.tokens) for s in mb.sequences), mb.num_tokens) for mb in micro_batches]  # padded
    if spec.get("dump_state"):
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
        torch.save({"state": state, "batch": batch}, spec["dump_state"])
    for step in range(spec.get("steps", 0)):
        poison = None
        if spec.get("nan_grad") == [torch.distributed.get_rank(), step]:  # a NaN gradient on this rank, this step
            first = next(p for p in trainer.model.parameters() if p.requires_grad)
            poison = first.register_hook(lambda grad: grad * float("nan"))
        if spec.get("on_policy"):  # generator log-probs = the current policy's: the loss is the PG objective
            logprobs = iter(trainer.compute_logprobs(batch))
            for group in batch:
                for completion in group.completions:
                    completion.gen_logprobs = next(logprobs)
        metrics = trainer.train_step(batch)
        if poison is not None:
            poison.remove()
        keys = ("train/loss", "train/grad_norm", "train/mismatch", "train/skipped_steps", "train/lr")
        result["steps"].append({k: metrics[k] for k in keys})
        result.setdefault("step_metrics", []).append(metrics)
        result.setdefault("versions", []).append(trainer.step)
        result.setdefault("weights", []).append(
            float(sum(p.detach().double().abs().sum() for p in trainer.model.parameters()))
        )
        if checkpoints is not None:
            result["checkpoints"].append(_take(checkpoints))
        if spec.get("grads") and step == spec.get("grads_step", spec["steps"] - 1):
            result["grads"] = {n: p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()}
        if spec.get("save_after") == len(result["steps"]):
            save_checkpoint(trainer, spec["save"], {"note": "test"})
    if spec.get("dump_final"):  # every parameter after the steps
        final = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
        torch.save(final, f"{spec['dump_final']}.rank{torch.distributed.get_rank()}")
        result["optimizer"] = type(trainer.optimizer.optimizer).__name__
    if spec.get("save") and not spec.get("save_after"):
        save_checkpoint(trainer, spec["save"], {"note": "test"})
    if spec.get("save"):  # a synchronous save leaves no helper process behind (megatron's Manager queue)
        import multiprocessing

        result["save_children"] = [p.name for p in multiprocessing.active_children()]
    if spec.get("grads"):  # this rank's gradients of step `grads_step` (megatron's fp32 main_grad buffers; default:
        # the last step), recorded above
        result["tp_dims"] = {  # the dimension a TP-split parameter is split along
            n: p.partition_dim
            for n, p in trainer.model.named_parameters()
            if getattr(p, "tensor_model_parallel", False)
        }
    if collectives is not None:
        result["collectives"] = collectives
        result["device"] = trainer.info.device.type
    from megatron_rl.trainer.model import output_weight

    head = output_weight(trainer.model) if trainer.model.post_process else None  # the shared weight when tied
    if head is not None:
        result["head_dtype"] = str(head.dtype)
        result["head_grad_dtype"] = str(head.main_grad.dtype) if getattr(head, "main_grad", None) is not None else None
        result["body_dtype"] = str(next(trainer.model.decoder.parameters()).dtype)
    if spec.get("te_standin"):
        from megatron_rl.trainer import te_standin

        result["te_calls"] = [(c.cls, c.method, c.arguments) for c in te_standin.CALLS]
        result["layer_types"] = sorted({type(m).__name__ for m in trainer.model.modules()})
    result["ep_rank"] = trainer.info.ep_rank
    rank = torch.distributed.get_rank()
    torch.save(result, f"{spec['out']}.rank{rank}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
