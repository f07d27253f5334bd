"""Write the constructor and forward signatures of the Transformer Engine classes that megatron-core builds, read
from a Transformer Engine release's own Python sources (its `transformer-engine` wheel is pure Python: the
classes are parsed with `ast`, nothing is imported), to megatron_rl/trainer/te_signatures.json.

    pip download --no-deps transformer-engine==2.18.0 -d /tmp/te
    python tools/te_signatures.py /tmp/te/transformer_engine-2.18.0-py3-none-any.whl

The Transformer Engine stand-in (megatron_rl/trainer/te_standin.py) checks every call megatron makes against
these signatures.
"""

from __future__ import annotations

import ast
import json
import sys
import zipfile
from pathlib import Path

CLASSES = {
    "Linear": "transformer_engine/pytorch/module/linear.py",
    "LayerNormLinear": "transformer_engine/pytorch/module/layernorm_linear.py",
    "GroupedLinear": "transformer_engine/pytorch/module/grouped_linear.py",
    "RMSNorm": "transformer_engine/pytorch/module/rmsnorm.py",
    "LayerNorm": "transformer_engine/pytorch/module/layernorm.py",
    "DotProductAttention": "transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py",
}
OUT = Path(__file__).resolve().parent.parent / "megatron_rl" / "trainer" / "te_signatures.json"


def _parameters(fn: ast.FunctionDef) -> dict[str, object]:
    args = fn.args
    positional = [a.arg for a in args.posonlyargs + args.args][1:]  # without self
    required = positional[: len(positional) - len(args.defaults)]
    keyword_only = [a.arg for a in args.kwonlyargs]
    required += [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None]
    return {
        "positional": positional,
        "keyword_only": keyword_only,
        "required": required,
        "var_keyword": args.kwarg is not None,
    }


def signatures(wheel: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    with zipfile.ZipFile(wheel) as zf:
        version = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(version).decode()
        out["version"] = next(
            line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Version:")
        )
        for cls, path in CLASSES.items():
            tree = ast.parse(zf.read(path).decode())
            node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
            methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
            # the norms inherit forward(input) from their fusible operation
            out[cls] = {"source": path, **{m: _parameters(methods[m]) for m in ("__init__", "forward") if m in methods}}
    return out


if __name__ == "__main__":
    data = signatures(Path(sys.argv[1]))
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{OUT}: Transformer Engine {data['version']}, {len(CLASSES)} classes")
