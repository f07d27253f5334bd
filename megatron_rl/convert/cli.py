"""`megatron-rl convert` (and tools/convert_checkpoint.py): Hugging Face <-> megatron_rl checkpoints.

    megatron-rl convert --from-hf HF_DIR --out CKPT [--tp 2 --pp 1 --ep 1] [--model NAME] [model.x=y ...]
    megatron-rl convert --to-hf CKPT --out HF_DIR [--hf-source HF_DIR] [--shard-size 5GB] [--dtype bf16]

--from-hf writes a megatron-core distributed checkpoint (step 0, model only) as the given layout's
tp x pp x ep ranks would: they are spawned here (CPU, or one GPU each), or run it under torchrun with
that many ranks. Without --model the ModelConfig comes from the HF config.json. --to-hf reads a
checkpoint saved under any layout (a step directory, or a run's checkpoint root: its `latest` is
followed) in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig, apply_overrides, build, load_model_dict


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl convert", description="Convert between Hugging Face and megatron_rl checkpoints."
    )
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", metavar="HF_DIR", help="import an HF directory into a megatron_rl checkpoint")
    way.add_argument("--to-hf", metavar="CKPT", help="export a megatron_rl checkpoint to an HF directory")
    parser.add_argument("--out", required=True, help="output directory (checkpoint or HF directory)")
    parser.add_argument("--model", help="model config name or YAML (default: config.json / megatron_rl.json)")
    parser.add_argument("overrides", nargs="*", metavar="model.field=value", help="model config overrides")
    imp = parser.add_argument_group("--from-hf")
    imp.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the checkpoint's layout")
    imp.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    imp.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    imp.add_argument("--params-dtype", choices=("bf16", "fp32"), default="bf16", help="trainer.params_dtype")
    imp.add_argument("--no-fp32-lm-head", action="store_true", help="keep the output layer in --params-dtype")
    exp = parser.add_argument_group("--to-hf")
    exp.add_argument(
        "--hf-source",
        help="HF directory for config.json and tokenizer (default: model.hf_path, else the run's starting model)",
    )
    exp.add_argument("--shard-size", default="5GB", help="largest safetensors shard (5GB, 500MB, ...)")
    exp.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast every tensor (default: as saved)")
    exp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _model_config(args: argparse.Namespace) -> ModelConfig | None:
    bad = [o for o in args.overrides if not o.startswith("model.")]
    if bad:
        raise ConfigError(f"{bad[0]}: convert takes model.* overrides only")
    if args.model:
        data = load_model_dict(args.model)
    elif args.from_hf:
        from megatron_rl.models import model_config_from_hf

        data = dataclasses.asdict(model_config_from_hf(args.from_hf))
    elif args.overrides:
        raise ConfigError("model overrides with --to-hf need --model (the checkpoint's own config is used otherwise)")
    else:
        return None
    data = apply_overrides({"model": data}, args.overrides)["model"]
    return build(ModelConfig, data, prefix="model")  # type: ignore[no-any-return]


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = _model_config(args)
        if args.from_hf:
            from megatron_rl.convert import import_hf

            assert cfg is not None
            world = args.tp * args.pp * args.ep
            parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, trainer_devices=world)
            out = import_hf(
                args.from_hf,
                cfg,
                parallel,
                args.out,
                params_dtype=args.params_dtype,
                fp32_lm_head=not args.no_fp32_lm_head,
            )
            print(f"wrote megatron_rl checkpoint {out} (tp={args.tp}, pp={args.pp}, ep={args.ep})")
        else:
            from megatron_rl.convert import export_hf

            out = export_hf(
                args.to_hf,
                args.out,
                model_cfg=cfg,
                hf_source=args.hf_source,
                shard_size=args.shard_size,
                dtype=args.dtype,
                progress=not args.no_progress,
            )
            print(f"wrote Hugging Face directory {out}")
    except ConfigError as exc:
        print(f"megatron-rl convert: config error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, FileExistsError, KeyError, RuntimeError) as exc:
        print(f"megatron-rl convert: error: {exc}", file=sys.stderr)
        return 1
    return 0
