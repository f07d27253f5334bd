#!/usr/bin/env bash
# Install megatron_rl into a virtual environment on a fresh machine (CPU or GPU node).
#
#   bash tools/install.sh            # creates .venv (override with VENV=path)
#
# Order matters:
# 1. torch first, pinned by tools/constraints.txt for every later pip call: any package asking for a
#    newer torch would otherwise pull several GB of CUDA builds onto a CPU machine.
# 2. megatron-core 0.19.2 without its Python check. Every megatron-core release from 0.17 declares
#    Requires-Python >= 3.12, so pip on 3.11 would silently pick 0.16.1; the 0.19.2 wheel itself is
#    tagged cp311 and runs on 3.11 (docs/cpu.md §2). We take 0.19.2 over 0.16.1 for what the
#    recipe needs: Llama-4 pieces (qk_l2_norm, no_rope_freq, shared experts, router probs on the input),
#    GPTModel's output processor for the FP32 head, and fixes to the MoE router without Transformer
#    Engine (0.16.1 references te_general_gemm unbound). Its dependencies are installed by hand
#    (--no-deps, otherwise pip tries to build numpy from source): numpy, packaging, psutil, and triton
#    (imported unconditionally by one MoE module; no CUDA needed).
# 3. the package itself (editable) with its dev tools, and the code sandbox (bubblewrap).
# Pure-Python packages go in with uv (the version tools/gpu_lock.py pins): the same versions as pip resolves, in
# ~15 s instead of ~150 s; if uv fails, pip does it. torch and megatron-core stay with pip (pip.conf's local torch
# wheel, --ignore-requires-python).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0
MCORE_VERSION=0.19.2

python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT="$PWD/tools/constraints.txt"
pip install -q --upgrade pip
pip install -q "torch==$TORCH_VERSION"
pip install -q "uv==$(sed -n 's/^UV_VERSION = "\(.*\)"/\1/p' tools/gpu_lock.py)"
# shellcheck source=tools/pkg_install.sh
. tools/pkg_install.sh

if ! python -c "import megatron.core, sys; sys.exit(megatron.core.__version__ != '$MCORE_VERSION')" 2>/dev/null; then
  wheels=$(mktemp -d)
  pip download -q --no-deps --ignore-requires-python --only-binary=:all: -d "$wheels" "megatron-core==$MCORE_VERSION"
  pip install -q --no-deps --ignore-requires-python "$wheels"/megatron_core-*.whl
  rm -rf "$wheels"
fi
pkg_install numpy packaging psutil triton -e ".[dev]"

# Optional parts, each with its own script: the code sandbox (bubblewrap) and SGLang on CPU.
for part in tools/install_sandbox.sh tools/install_sglang.sh; do
  if [ -f "$part" ]; then
    bash "$part"
  fi
done

python - <<'PY'
import megatron.core, torch
print(f"megatron_rl installed: torch {torch.__version__}, megatron-core {megatron.core.__version__}")
PY
