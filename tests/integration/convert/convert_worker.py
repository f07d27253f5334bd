"""A trainer-side rank for the conversion tests (tests/integration/convert/test_convert.py launches 1 or 2 of them).

    python tests/integration/convert/convert_worker.py SPEC_JSON

SPEC: {"out": file, "jobs": [{"model": yaml, "overrides": [...], "hf": dir, "tp", "pp", "ep",
       "tokens": [[ids]], "save": dir or null}]}. The jobs run one after another in the same process group,
each under its own megatron layout. For each job every rank imports the HF directory into its shards,
then rank 0 records: megatron's fp32 logits of every token row, whether iter_full_weights gave back
exactly the tensors built from the HF files at TP=PP=EP=1, whether load_full_weights -> iter_full_weights
is the identity, the HF names weight sync would send (with their tensors), and the saved checkpoint path.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def megatron_logits(gpt, tokens: list[int]) -> torch.Tensor:
    """[seq, vocab] fp32 logits on every rank (pipeline stages by p2p, vocab shards gathered over TP)."""
    from megatron.core import parallel_state as ps

    ids = torch.tensor([tokens])
    positions = torch.arange(len(tokens))[None]
    pp_group, pp_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    pp_size = ps.get_pipeline_model_parallel_world_size()
    hidden_shape = (len(tokens), 1, gpt.config.hidden_size)
    if pp_rank > 0:
        hidden = torch.empty(hidden_shape, dtype=gpt.config.params_dtype)
        dist.recv(hidden, src=dist.get_global_rank(pp_group, pp_rank - 1), group=pp_group)
        gpt.set_input_tensor(hidden)
    with torch.no_grad():
        out = gpt(ids, positions, None)  # one causal sequence per row
    if pp_rank < pp_size - 1:
        dist.send(out.contiguous(), dst=dist.get_global_rank(pp_group, pp_rank + 1), group=pp_group)
    logits = torch.empty(len(tokens), gpt.vocab_size, dtype=torch.float32)
    if pp_rank == pp_size - 1:
        shards = [torch.empty_like(out[0]) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(shards, out[0].contiguous(), group=ps.get_tensor_model_parallel_group())
        logits = torch.cat(shards, dim=-1).float()
    dist.broadcast(logits, src=dist.get_global_rank(pp_group, pp_size - 1), group=pp_group)
    return logits


def run_job(job: dict, world: int) -> dict:
    from pathlib import Path

    from megatron_rl.config import ParallelConfig, TrainerConfig, load_config
    from megatron_rl.convert import import_hf
    from megatron_rl.convert.hf_files import HFReader
    from megatron_rl.convert.hf_import import write_metadata
    from megatron_rl.convert.runtime import megatron_process
    from megatron_rl.models import HFMapper, canonical_shapes, from_hf
    from megatron_rl.trainer.model import build_model
    from megatron_rl.trainer.weights import full_shapes, iter_full_weights, iter_hf_weights, load_full_weights

    cfg = load_config("scalerl-cpu", job["model"], job.get("overrides", [])).model
    parallel = ParallelConfig(tp=job.get("tp", 1), pp=job.get("pp", 1), ep=job.get("ep", 1), trainer_devices=world)
    trainer = TrainerConfig(params_dtype="fp32", fp32_lm_head=True)
    result: dict = {}
    with megatron_process(parallel, seed=7, moe=cfg.is_moe):
        gpt = build_model(cfg, parallel, trainer)
        import_hf(job["hf"], cfg, parallel, model=gpt)
        result["logits"] = [megatron_logits(gpt, tokens) for tokens in job["tokens"]]
        reader = HFReader(job["hf"])
        truth = {recipe.name: recipe.build(reader) for recipe in from_hf(cfg)}  # TP=PP=EP=1, from the files
        full = [(name, t.clone()) for bucket in iter_full_weights(gpt, 1 << 14) for name, t in bucket]
        result["names"] = [name for name, _ in full]
        shapes = {name: shape for name, shape, _ in full_shapes(gpt)}
        result["shapes_match"] = shapes == canonical_shapes(cfg) == {name: tuple(t.shape) for name, t in full}
        result["full_equal"] = sorted(truth) == sorted(result["names"]) and all(
            torch.equal(truth[name], t) for name, t in full
        )
        with torch.no_grad():
            for param in gpt.parameters():
                param.zero_()
        load_full_weights(gpt, full)
        again = [(name, t) for bucket in iter_full_weights(gpt) for name, t in bucket]
        result["reload_equal"] = [n for n, _ in again] == result["names"] and all(
            torch.equal(a, b) for (_, a), (_, b) in zip(full, again, strict=True)
        )
        result["hf"] = {name: t.clone() for bucket in iter_hf_weights(gpt, cfg, 1 << 12) for name, t in bucket}
        result["hf_direct"] = dict(HFMapper(cfg).map_all(truth.items()))
        if job.get("errors"):
            result["errors"] = errors(gpt, cfg, full, job["hf"])
        if job.get("save"):
            from megatron.core import dist_checkpointing

            if dist.get_rank() == 0:
                Path(job["save"]).mkdir(parents=True, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save({"model": gpt.sharded_state_dict()}, job["save"])
            if dist.get_rank() == 0:
                write_metadata(Path(job["save"]), cfg, parallel, trainer.params_dtype, Path(job["hf"]))
            dist.barrier()
    return result


def errors(gpt, cfg, full: list, hf_dir: str) -> dict[str, str]:
    """The messages of a bad load_full_weights and of an import into the wrong layout."""
    from megatron_rl.config import ParallelConfig
    from megatron_rl.convert import import_hf
    from megatron_rl.trainer.weights import load_full_weights

    named = [(n, t[:, :-1] if n == "embedding.word_embeddings.weight" else t) for n, t in full]
    named = [(n, t) for n, t in named if n != "decoder.final_layernorm.weight"]
    named.append(("decoder.layers.0.mlp.experts.local_experts.9.linear_fc1.weight", torch.zeros(1)))
    out = {}
    try:
        load_full_weights(gpt, named)
    except ValueError as exc:
        out["load"] = str(exc)
    try:
        import_hf(hf_dir, cfg, ParallelConfig(tp=2, trainer_devices=2), model=gpt)
    except ValueError as exc:
        out["layout"] = str(exc)
    return out


def main(spec: dict) -> None:
    from megatron_rl.ports import free_port

    torch.set_num_threads(1)
    import os

    world = int(os.environ.get("WORLD_SIZE", 1))
    if not dist.is_initialized():
        addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), os.environ.get("MASTER_PORT") or free_port()
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{port}", rank=int(os.environ.get("RANK", 0)), world_size=world
        )
    results = [run_job(job, world) for job in spec["jobs"]]
    if dist.get_rank() == 0:
        torch.save(results, spec["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
