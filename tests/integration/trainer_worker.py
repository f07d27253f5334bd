"""A trainer rank for the multi-process trainer tests (tests/integration/test_trainer.py launches it).

    python tests/integration/trainer_worker.py SPEC_JSON

SPEC: {"model": ..., "overrides": [...], "load": ckpt or null, "save": ckpt root or null,
       "steps": n, "out": file, "batch": fixed_batch() arguments, "hf": HF dir to load, ...}.
Every rank writes its results to `out.rank<r>`: log-probs of a fixed batch before training, then the loss and
grad norm of each step.
"""

from __future__ import annotations

import json
import random
import sys

import torch


def fixed_batch(
    seed: int = 0,
    prompts: int = 4,
    group: int = 4,
    vocab: int = 500,
    prompt_len: tuple[int, int] = (3, 9),
    completion_len: tuple[int, int] = (2, 12),
) -> list:
    """Groups of random tokens; lengths drawn from [low, high) (prompt per group, completion per sample)."""
    from megatron_rl.rollout.types import Completion, Group

    rng = random.Random(seed)
    groups = []
    for p in range(prompts):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randrange(*prompt_len))]
        completions = []
        for g in range(group):
            n = rng.randrange(*completion_len)
            completions.append(
                Completion(
                    prompt_id=str(p),
                    task="math",
                    prompt_tokens=prompt,
                    tokens=[rng.randrange(5, vocab) for _ in range(n)],
                    gen_logprobs=[-6.0 + 0.1 * rng.random() for _ in range(n)],
                    versions=[0] * n,
                    loss_mask=[i != 1 for i in range(n)],  # one masked (injected) token per completion
                    reward=float((p + g) % 2 * 2 - 1),
                )
            )
        groups.append(Group(str(p), "math", completions))
    return groups


COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
    "send", "recv", "isend", "irecv", "reduce_scatter", "all_to_all", "_all_gather_base", "_reduce_scatter_base",
)  # fmt: skip


def _record_collective_devices() -> dict[str, set[str]]:
    """Wrap torch.distributed's collectives (megatron's calls included) and record the device type of every
    tensor each one receives: {collective name: {device types}}."""
    import torch.distributed as dist

    seen: dict[str, set[str]] = {}

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from tensors(item)

    def wrap(name, fn):
        def collective(*args, **kwargs):
            for tensor in tensors(list(args) + list(kwargs.values())):
                seen.setdefault(name, set()).add(tensor.device.type)
            return fn(*args, **kwargs)

        return collective

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    p2p_op = dist.P2POp.__init__

    def p2p_init(self, op, tensor, *args, **kwargs):
        seen.setdefault("batch_isend_irecv", set()).add(tensor.device.type)
        p2p_op(self, op, tensor, *args, **kwargs)

    dist.P2POp.__init__ = p2p_init
    return seen


def main(spec: dict) -> None:
    from megatron_rl.config import load_config
    from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.trainer.step import Trainer, sequences_from_groups

    torch.set_num_threads(1)
    devices = _record_collective_devices() if spec.get("record_collectives") else None
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
    if spec.get("dump_batch") and torch.distributed.get_rank() == 0:
        torch.save(batch, spec["dump_batch"])
    if spec.get("dump_hf"):
        from megatron_rl.trainer.weights import iter_hf_weights

        exported = {
            name: t.clone() for bucket in iter_hf_weights(trainer.model, run.model, 1 << 16) for name, t in bucket
        }
        if torch.distributed.get_rank() == 0:
            torch.save(exported, spec["dump_hf"])
    result: dict = {"logprobs": trainer.compute_logprobs(batch), "steps": []}
    result["micro_batches"] = [len(mb.sequences) for mb in trainer._micro_batches(sequences_from_groups(batch, run))]
    if spec.get("dump_state"):
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}
        torch.save({"state": state, "batch": batch}, spec["dump_state"])
    for _ in range(spec.get("steps", 0)):
        if spec.get("on_policy"):  # generator log-probs = the current policy's: the loss is the PG objective
            logprobs = iter(trainer.compute_logprobs(batch))
            for group in batch:
                for completion in group.completions:
                    completion.gen_logprobs = next(logprobs)
        metrics = trainer.train_step(batch)
        result["steps"].append({k: metrics[k] for k in ("train/loss", "train/grad_norm", "train/mismatch")})
        if spec.get("save_after") == len(result["steps"]):
            save_checkpoint(trainer, spec["save"], {"note": "test"})
    if spec.get("save") and not spec.get("save_after"):
        save_checkpoint(trainer, spec["save"], {"note": "test"})
    if spec.get("grads"):  # this rank's gradients of the last step (megatron's fp32 main_grad buffers)
        result["grads"] = {n: p.main_grad.detach().clone() for n, p in trainer.model.named_parameters()}
    if devices is not None:
        result["collective_devices"] = devices
    head = trainer.model.output_layer.weight if trainer.model.post_process else None
    if head is not None:
        result["head_dtype"] = str(head.dtype)
        result["head_grad_dtype"] = str(head.main_grad.dtype) if getattr(head, "main_grad", None) is not None else None
        result["body_dtype"] = str(next(trainer.model.decoder.parameters()).dtype)
    rank = torch.distributed.get_rank()
    torch.save(result, f"{spec['out']}.rank{rank}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
