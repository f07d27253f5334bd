"""Hugging Face <-> Megatron checkpoint conversion, on the family mappings of megatron_rl/models/.

    import_hf(hf_dir, model=gpt)                 import: stream an HF directory into this rank's shards
    import_hf(hf_dir, cfg, parallel, out=ckpt)   import: write a megatron_rl checkpoint for a TP/PP/EP layout
    export_hf(ckpt, out_dir)                     export: a megatron_rl checkpoint (any layout) -> HF directory

`megatron-rl convert` (convert/cli.py) is the command line over both.
"""

from megatron_rl.convert.hf_export import export_hf
from megatron_rl.convert.hf_import import import_hf, load_hf_into_model

__all__ = ["export_hf", "import_hf", "load_hf_into_model"]
