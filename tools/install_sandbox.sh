#!/usr/bin/env bash
# Install the code sandbox's isolation tool: bubblewrap (Debian/Ubuntu package `bubblewrap`).
#
#   bash tools/install_sandbox.sh
#
# megatron_rl/rewards/sandbox.py runs model-written programs inside bwrap (fresh network, PID, IPC,
# UTS and user namespaces; read-only system directories; a private scratch directory). Without bwrap
# the code reward refuses to run and says why. As root (containers, CI) we install it with apt-get;
# as a non-root user we print what to run and exit 0, so the rest of tools/install.sh still completes.
set -euo pipefail

if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "install_sandbox: bubblewrap (bwrap) is missing and we are not root." >&2
    echo "install_sandbox: run 'sudo apt-get install -y bubblewrap'; until then the code reward refuses to run." >&2
    exit 0
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_sandbox: bubblewrap is missing and apt-get is not available; install bubblewrap with your" >&2
    echo "install_sandbox: package manager. Until then the code reward refuses to run." >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
fi

# bwrap needs namespaces; some container runtimes forbid them. Report it here rather than at the
# first code reward (sandbox.py checks again at start-up and gives the same advice).
if bwrap --unshare-all --die-with-parent --ro-bind / / --proc /proc --dev /dev true 2>/dev/null; then
  echo "install_sandbox: bubblewrap $(bwrap --version | awk '{print $2}') works"
else
  echo "install_sandbox: bubblewrap is installed but cannot create namespaces here (user namespaces" >&2
  echo "install_sandbox: disabled, or a seccomp profile forbids unshare); the code reward will refuse to run." >&2
fi
