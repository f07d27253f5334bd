#!/usr/bin/env bash
# SGLang on a CPU machine, for the CPU run and the integration tests. tools/install.sh calls it with the
# venv active and PIP_CONSTRAINT pinning torch; it can be rerun at any time (it does nothing when the
# install is already complete). On a GPU node it does nothing: install the `gpu` extra there
# (`pip install -e .[gpu]`, SGLang with its CUDA kernels).
#
#   bash tools/install_sglang.sh        # with the venv active (or VENV=path, default .venv)
#
# What it takes (docs/cpu.md §4), every step only when CUDA is absent:
# 1. sglang==0.5.23 with --no-deps: its metadata pins torch==2.14.1 and CUDA-only wheels (sglang-kernel,
#    flashinfer, deep-gemm, ...); a plain install would download GBs and replace our torch. Then its
#    pure-Python needs, under the torch constraint. `pip check` will report the pins this leaves unmet
#    (torch, transformers, tokenizers, the CUDA wheels): SGLang's CPU path does not use them.
# 2. torchvision with --no-deps: SGLang imports torchvision.transforms. The only wheel on the registries
#    is CUDA-linked; its C++ ops never register under CPU torch, and `import torchvision` then fails in
#    its `_meta_registrations` ("operator torchvision::nms does not exist"). We do NOT edit torchvision:
#    patch (a) below skips those registrations.
# 3. tools/sglang_cpu, a small package installed into site-packages (`pip uninstall
#    megatron-rl-sglang-cpu` removes all of it), with the two patches:
#    (a) megatron_rl_sglang_cpu.pth + megatron_rl_sglang_cpu.py: an import hook that answers
#        `torchvision._meta_registrations` and `torchvision._autograd_registrations` with empty modules,
#        only when torch has no CUDA and torchvision's ops are not registered (then there is nothing for
#        them to register). Calling a torchvision op still fails loudly.
#    (b) sgl_kernel: a placeholder for SGLang's kernel package, which has no CPU wheel (the CPU build
#        needs Intel AMX sources). SGLang imports some of its names at start-up; on the torch-native path
#        (`--device cpu --attention-backend torch_native`, with SGLANG_USE_CPU_ENGINE=1, both set by
#        megatron_rl/generator/server.py) none is called. Each name raises KernelUnavailable if called.
# The last step checks that `python -m sglang.launch_server --help` works.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${VIRTUAL_ENV:-}" ]; then
  # shellcheck disable=SC1091
  . "${VENV:-.venv}/bin/activate"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CONSTRAINT="${PIP_CONSTRAINT:-$PWD/tools/constraints.txt}"

if python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "install_sglang.sh: CUDA is available; install SGLang with its kernels instead: pip install -e .[gpu]"
  exit 0
fi

SGLANG_VERSION=0.5.23
TORCHVISION_VERSION=0.28.0 # the release built against torch 2.13
SHIM_VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' tools/sglang_cpu/pyproject.toml)

# SGLang's pure-Python needs (its Requires-Dist minus torch, the CUDA-only wheels, and what the CPU server
# never imports: anthropic, modelscope, outlines, timm, torchaudio, torchcodec, py-spy, ...). Pins
# follow SGLang's where its API depends on them.
DEPS=(
  aiohttp blobfile distro easydict einops fastapi gguf interegular ipython "llguidance>=1.7.6,<2"
  "mistral_common>=1.11.5" msgspec ninja numba "openai==2.8.0" "openai-harmony==0.0.4" orjson
  partial_json_parser pillow "prometheus-client>=0.20" pybase64 pydantic python-multipart "pyzmq>=25.1.2"
  regex requests sentencepiece setproctitle soundfile tiktoken "torch_memory_saver>=0.0.9.post1"
  "uvicorn>=0.51" uvloop watchfiles "xgrammar==0.2.7" xxhash zstandard "compressed-tensors==0.18.0"
)

check() {
  # Quiet: the server's import chain, then its command line, as the server process will run them.
  SGLANG_USE_CPU_ENGINE=1 python - "$SGLANG_VERSION" "$SHIM_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md
import sys

assert md.version("sglang") == sys.argv[1], md.version("sglang")
assert md.version("megatron-rl-sglang-cpu") == sys.argv[2]
import sglang.srt.entrypoints.http_server  # noqa: F401,E402
PY
}

if check; then
  echo "install_sglang.sh: SGLang $SGLANG_VERSION for CPU is already installed"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
log=$work/pip.log
# shellcheck source=tools/pkg_install.sh
. tools/pkg_install.sh
quiet() {
  # pip's "requires X, but you have Y" notes about SGLang's unmet GPU pins are expected; real failures
  # stop the script with the installer's output.
  if ! "$@" >"$log" 2>&1; then
    cat "$log" >&2
    echo "install_sglang.sh: $* failed" >&2
    exit 1
  fi
}

echo "install_sglang.sh: installing SGLang $SGLANG_VERSION for CPU"
# An earlier version of this script edited torchvision/__init__.py in place; put the wheel's file back.
tv_init=$(python -c "import importlib.util as u; s = u.find_spec('torchvision'); print(s.origin if s else '')")
if [ -n "$tv_init" ] && grep -qs "megatron_rl CPU patch" "$tv_init"; then
  quiet pip install -q --no-deps --force-reinstall "torchvision==$TORCHVISION_VERSION"
fi
quiet pkg_install --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
quiet pkg_install "${DEPS[@]}"
# The shims build from a copy (no build/ left in the tree) with the venv's setuptools (nothing to download).
cp -r tools/sglang_cpu "$work/shims"
quiet pip install -q --no-deps --no-build-isolation --force-reinstall "$work/shims"

if ! check; then
  echo "install_sglang.sh: SGLang still does not import on CPU:" >&2
  SGLANG_USE_CPU_ENGINE=1 python -c "import sglang.srt.entrypoints.http_server" 2>&1 | tail -20 >&2
  exit 1
fi
if ! SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --help >"$log" 2>&1; then
  tail -20 "$log" >&2
  echo "install_sglang.sh: python -m sglang.launch_server --help failed" >&2
  exit 1
fi
echo "install_sglang.sh: SGLang $SGLANG_VERSION installed for CPU"
