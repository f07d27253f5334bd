"""Hugging Face <-> Megatron checkpoint conversion, on the family mappings of megatron_rl/models/.

    import_hf(hf_dir, model=gpt)                 import: stream an HF directory into this rank's shards
    import_hf(hf_dir, cfg, parallel, out=ckpt)   import: write a megatron_rl checkpoint for a TP/PP/EP layout
    export_hf(ckpt, out_dir)                     export: a megatron_rl checkpoint (any layout) -> HF directory

`megatron-rl convert` (convert/cli.py) is the command line over both.
"""

from __future__ import annotations

from typing import Any

__all__ = ["export_hf", "import_hf", "load_hf_into_model"]


def __getattr__(name: str) -> Any:
    """The three entry points, imported on first use: they bring torch, and `convert.hf_headers` (the torch-free
    checks the training driver runs on its starting checkpoint) must not."""
    if name == "export_hf":
        from megatron_rl.convert.hf_export import export_hf

        return export_hf
    if name in ("import_hf", "load_hf_into_model"):
        from megatron_rl.convert import hf_import

        return getattr(hf_import, name)
    raise AttributeError(f"module 'megatron_rl.convert' has no attribute {name!r}")
