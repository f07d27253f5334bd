#!/usr/bin/env bash
# SGLang on a CPU machine, for the CPU default run and the integration tests (tools/install.sh calls it
# with the venv active and PIP_CONSTRAINT pinning torch). On GPU clusters install the `gpu` extra instead
# (`pip install -e .[gpu]`, SGLang with its CUDA kernels) and this script does nothing.
#
# What it takes (../shared/FINDINGS.md, "SGLang"):
# 1. sglang==0.5.23 without its dependencies (it pins torch==2.14.1 and CUDA-only kernel wheels), then
#    its pure-Python needs under our torch pin. pip reports the pins it does not meet (torch,
#    transformers, tokenizers, sentencepiece, soundfile): they are harmless on the CPU path.
# 2. torchvision without its dependencies: SGLang's config modules import torchvision.transforms. PyPI's
#    wheel has CUDA-linked C ops whose fake-op registrations fail under CPU torch, so that one import in
#    torchvision/__init__.py is made optional (patched in place, idempotent, marked "megatron_rl CPU patch").
# 3. a placeholder `sgl_kernel` (tools/sglang_cpu/sgl_kernel): the real one has no CPU wheel; SGLang
#    imports a few names at start-up that the torch-native attention path never calls. Each raises if
#    called. The server must run with SGLANG_USE_CPU_ENGINE=1 (rollout/sglang.py sets it).
set -euo pipefail
cd "$(dirname "$0")/.."

if python -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then :; else
  echo "install_sglang.sh: CUDA present; install SGLang with its kernels (pip install -e .[gpu])"
  exit 0
fi

SGLANG_VERSION=0.5.23
TORCHVISION_VERSION=0.28.0  # the release built against torch 2.13

pip install -q --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
pip install -q aiohttp blobfile distro easydict einops fastapi gguf interegular ipython \
  "llguidance>=1.7.6,<2" "mistral_common>=1.11.5" msgspec ninja numba "openai==2.8.0" "openai-harmony==0.0.4" \
  orjson partial_json_parser pillow prometheus-client pybase64 pydantic python-multipart "pyzmq>=25.1.2" regex \
  requests sentencepiece setproctitle soundfile tiktoken torch_memory_saver "uvicorn>=0.51" uvloop watchfiles \
  "xgrammar==0.2.7" xxhash zstandard "compressed-tensors==0.18.0" 2>&1 | grep -v "requires\|dependency resolver" || true

python - <<'PY'
import importlib.util
import pathlib
import shutil

site = pathlib.Path(importlib.util.find_spec("sglang").origin).parent.parent
shutil.copytree("tools/sglang_cpu/sgl_kernel", site / "sgl_kernel", dirs_exist_ok=True)

init = pathlib.Path(importlib.util.find_spec("torchvision").origin)
text = init.read_text()
marker = "# megatron_rl CPU patch"
if marker not in text:
    text = text.replace("    _autograd_registrations,\n    _meta_registrations,\n", "")
    text = text.replace(
        "from . import extension  # usort:skip  # noqa: F401\n",
        "from . import extension  # usort:skip  # noqa: F401\n"
        f"try:  {marker}: the PyPI wheel's C ops are CUDA-linked; on CPU torch these registrations fail\n"
        "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
        "except RuntimeError:\n"
        "    pass\n",
        1,
    )
    init.write_text(text)
PY

SGLANG_USE_CPU_ENGINE=1 python -c "import sglang.srt.entrypoints.http_server" >/dev/null
echo "SGLang $SGLANG_VERSION installed for CPU"
