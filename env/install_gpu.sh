#!/usr/bin/env bash
# Installs env/gpu-requirements.lock, then megatron_rl, into a Python 3.12 virtual environment. Run at image build
# time by env/Dockerfile and env/megatron_rl.def (as root, with network; no GPU needed), in two steps so that a
# code change does not rebuild the dependencies:
#
#   bash env/install_gpu.sh deps       # needs env/gpu-requirements.lock and tools/gpu_lock.py under $MRL_SRC
#   bash env/install_gpu.sh package    # needs the whole source tree under $MRL_SRC
#
# The base image must provide python3.12 (with venv and headers), the CUDA 13.0 toolkit (nvcc, headers) and g++.
set -euo pipefail

SRC=${MRL_SRC:-/opt/megatron_rl}
VENV=${MRL_VENV:-/opt/mrl/venv}
LOCK=$SRC/env/gpu-requirements.lock
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore

deps() {
  python3.12 -m venv "$VENV"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  python -m pip install -q --upgrade pip

  # 1. Every locked package but the Transformer Engine torch binding: exactly the locked versions (--no-deps: the
  #    lock is complete), wheels only, so nothing else is compiled. torch 2.14.1 comes from PyPI, whose linux
  #    x86_64 wheel is the CUDA 13.0 build; its CUDA libraries come as nvidia-* wheels.
  local wheels
  wheels=$(mktemp)
  grep -v '^transformer-engine-torch==' "$LOCK" >"$wheels"
  python -m pip install --no-deps --only-binary=:all: -r "$wheels"
  rm -f "$wheels"

  # 2. transformer-engine-torch: PyPI has only its source. Its setup.py first looks for NVIDIA's prebuilt wheel of
  #    this exact TE, torch and CUDA (a GitHub release asset) and otherwise compiles ~30 C++ files (a CppExtension,
  #    no CUDA kernels: those are in the transformer-engine-cu13 wheel) against the installed torch, so it must be
  #    built without isolation. It includes cudnn.h and nccl.h: take them from the nvidia wheels torch loads at run
  #    time rather than from the base image, so the binding is compiled against the libraries it runs with.
  local te site inc
  te=$(sed -n 's/^transformer-engine-torch==\([^ ]*\).*/\1/p' "$LOCK")
  site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  for header in cudnn.h nccl.h; do
    inc=$(find "$site/nvidia" -path "*/include/$header" -print -quit 2>/dev/null || true)
    if [ -n "$inc" ]; then CPATH="$(dirname "$inc")${CPATH:+:$CPATH}"; fi
  done
  export CPATH CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-4}
  python -m pip install --no-deps --no-build-isolation "transformer-engine-torch==$te"

  # 3. The environment holds exactly the lock (tools/gpu_lock.py --installed) and pip finds nothing unmet.
  python "$SRC/tools/gpu_lock.py" --installed
  python -m pip check
}

package() {
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  # Editable: megatron_rl reads model_configs/ next to its package directory (config.MODEL_CONFIGS_DIR), and a
  # checkout bound over $SRC at run time (env/mrl_setup_apptainer.sh, MRL_SRC) replaces the code in place.
  python -m pip install --no-deps -e "$SRC"
  python -m pip check
  # What can be checked without a GPU (Transformer Engine's and SGLang's kernels load only with a driver): torch's
  # CUDA build, the versions, and that the editable install finds model_configs/.
  python - <<'PY'
import importlib.metadata as md

import torch

from megatron_rl.config import list_model_configs

assert torch.version.cuda and torch.version.cuda.startswith("13."), torch.version.cuda
assert list_model_configs(), "model_configs/ not found next to the megatron_rl package"
names = ("torch", "megatron-core", "transformer-engine", "transformer-engine-torch", "sglang", "megatron-rl")
print("installed: " + ", ".join(f"{n} {md.version(n)}" for n in names) + f" (CUDA {torch.version.cuda})")
PY
}

case "${1:-}" in
  deps) deps ;;
  package) package ;;
  *)
    echo "usage: $0 deps|package" >&2
    exit 2
    ;;
esac
