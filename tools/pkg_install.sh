# Sourced by tools/install.sh and tools/install_sglang.sh, with the venv active and PIP_CONSTRAINT set:
# `pkg_install ARGS...` installs with uv when the venv has it (parallel downloads, ~10x faster than pip at
# resolving and unpacking the pure-Python packages), under the same constraints, compiling bytecode at install as
# pip does (or the first processes of a run would compile it), and falls back to pip if uv is
# missing or fails (an index only pip's configuration knows, say).
pkg_install() {
  if command -v uv >/dev/null 2>&1 && [ "$(command -v uv)" = "$VIRTUAL_ENV/bin/uv" ]; then
    if uv pip install -q --compile-bytecode --constraint "$PIP_CONSTRAINT" "$@"; then
      return 0
    fi
    echo "pkg_install: uv pip install failed; trying pip" >&2
  fi
  pip install -q "$@"
}
