#!/usr/bin/env bash
# Install the code sandbox's isolation tool: bubblewrap (Debian/Ubuntu package `bubblewrap`), and the
# system Python the sandboxed programs run with (/usr/bin/python3).
#
#   bash tools/install_sandbox.sh
#
# megatron_rl/rewards/sandbox.py runs model-written programs inside bwrap (fresh user, network, PID, IPC
# and UTS namespaces; read-only /usr; a private scratch directory). Without bwrap the code reward refuses
# to run and says why. As root (containers, CI) we install with apt-get; as a non-root user we print what
# to run and exit 0, so the rest of tools/install.sh still completes.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
[ -x /usr/bin/python3 ] || missing+=(python3)

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_sandbox: missing ${missing[*]}; install them (e.g. 'sudo apt-get install -y ${missing[*]}')." >&2
    echo "install_sandbox: until then the code reward refuses to run." >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# bwrap needs user namespaces, which some kernels and container runtimes forbid. Check with the sandbox
# itself (as it will run: nobody, unprivileged) when the package is installed, so the problem shows here
# rather than at the first code reward.
python=${VENV:-.venv}/bin/python
if [ -x "$python" ] && "$python" -c "import megatron_rl" 2>/dev/null; then
  "$python" - <<'PY'
from megatron_rl.config import SandboxConfig
from megatron_rl.rewards.sandbox import isolation_problem

problem = isolation_problem(SandboxConfig())
print(f"install_sandbox: {'PROBLEM: ' + problem if problem else 'the code sandbox works'}")
PY
elif bwrap --unshare-all --unshare-user --die-with-parent --ro-bind /usr /usr --symlink usr/lib /lib \
    --symlink usr/lib64 /lib64 --symlink usr/bin /bin --proc /proc --dev /dev /usr/bin/true 2>/dev/null; then
  echo "install_sandbox: bubblewrap $(bwrap --version | awk '{print $2}') works"
else
  echo "install_sandbox: bubblewrap cannot create namespaces here (user namespaces disabled, or a seccomp" >&2
  echo "install_sandbox: profile forbids unshare); the code reward will refuse to run." >&2
fi
