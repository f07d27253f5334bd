"""The GPU lock, env/gpu-requirements.lock: every Python package a GPU node runs, at one version each.

    python tools/gpu_lock.py --update                        # after an input change: same cut-off date
    python tools/gpu_lock.py --update --exclude-newer today  # move to today's releases
    python tools/gpu_lock.py --check        # resolve again with the lock's own cut-off date; same versions?
    python tools/gpu_lock.py --installed    # the running environment holds exactly the lock's versions

The lock is `uv pip compile` of pyproject.toml's dependencies with its `gpu` and `dev` extras plus the pins in
env/gpu-requirements.in, for linux x86_64 and Python 3.12 (megatron-core >= 0.17 declares Python >= 3.12), with
`--exclude-newer` set to the day it was made. --check runs that exact command again: the same inputs give the same
versions as long as PyPI serves what it served then. When it resolves to other versions, it resolves once more
with the lock's pins as constraints: the lock again means only the index changed (releases dated before the
cut-off that it now lists: reported, not an error); anything else means the inputs changed (pyproject.toml or
env/gpu-requirements.in: run --update) or something the lock names was removed from PyPI. --check needs PyPI
(about 10-20 s); without it, it says so and exits 3. --install-uv first installs the uv this script expects into the
running interpreter's environment. The offline half of the check (the lock against the versions the code pins) is
tests/unit/test_gpu_env.py. --installed runs in the image after the install (env/install_gpu.sh).

manylinux_2_34 is the oldest platform sglang 0.5.23 has a wheel for; the image (Ubuntu 24.04) has glibc 2.39.
"""

from __future__ import annotations

import argparse
import datetime as dt
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = "env/gpu-requirements.lock"
INPUT = "env/gpu-requirements.in"
PYTHON_VERSION = "3.12"
PLATFORM = "x86_64-manylinux_2_34"
EXTRAS = ("gpu", "dev")
UV_VERSION = "0.13.9"
TIMEOUT_S = 110
# The torch binding of Transformer Engine is the lock's one source distribution: env/install_gpu.sh builds it.
SOURCE_ONLY = ("transformer-engine-torch",)

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;#]+)")
_EXCLUDE_NEWER = re.compile(r"^# exclude-newer: (\S+)$", re.M)
_COMMAND = re.compile(r"^#    (uv pip compile .*)$", re.M)
# What uv prints when it cannot reach the index (as opposed to a resolution that fails).
_NETWORK_ERRORS = (
    "error sending request",
    "failed to fetch",
    "dns error",
    "failed to lookup address",
    "connection refused",
    "network is unreachable",
    "operation timed out",
    "tcp connect error",
)


class LockError(Exception):
    """A failure with a message for the person running the script, and the exit status to use."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of -_. as one dash."""
    return re.sub(r"[-_.]+", "-", name).lower()


def compile_args(exclude_newer: str) -> list[str]:
    """The `uv pip compile` arguments (paths relative to the repository root), without the output file."""
    args = ["uv", "pip", "compile", "pyproject.toml", INPUT]
    for extra in EXTRAS:
        args += ["--extra", extra]
    return args + [
        "--python-version",
        PYTHON_VERSION,
        "--python-platform",
        PLATFORM,
        "--exclude-newer",
        exclude_newer,
        "--no-config",
        "--no-python-downloads",
        "--no-header",
        "--quiet",
    ]


def command_line(exclude_newer: str) -> str:
    """The exact command recorded in the lock's header (run from the repository root)."""
    return shlex.join(compile_args(exclude_newer) + ["-o", LOCK])


def header(exclude_newer: str) -> str:
    return "\n".join(
        [
            "# Python packages of the GPU nodes (linux x86_64, Python 3.12, CUDA 13.0): what env/Dockerfile and",
            "# env/megatron_rl.def install. Do not edit: `python tools/gpu_lock.py --update` rewrites it with",
            f"# uv {UV_VERSION} from the repository root:",
            f"#    {command_line(exclude_newer)}",
            f"# exclude-newer: {exclude_newer}",
            "# Every entry is a wheel except transformer-engine-torch (PyPI has only its source): env/install_gpu.sh",
            "# installs the rest with --no-deps --only-binary=:all:, then builds that one against the locked torch.",
            "",
        ]
    )


def parse_pins(text: str) -> dict[str, str]:
    """{normalized name: version} of every `name==version` line."""
    pins = {}
    for line in text.splitlines():
        match = _PIN.match(line.strip())
        if match:
            pins[normalize(match.group(1))] = match.group(2)
    return pins


def parse_exclude_newer(text: str) -> str:
    match = _EXCLUDE_NEWER.search(text)
    if not match:
        raise LockError(f"{LOCK} has no '# exclude-newer:' line in its header; regenerate it with --update")
    return match.group(1)


def parse_command(text: str) -> str:
    match = _COMMAND.search(text)
    if not match:
        raise LockError(f"{LOCK} does not record its uv command in its header; regenerate it with --update")
    return match.group(1)


def _uv() -> str:
    try:
        from uv import find_uv_bin  # the uv package installed in this environment

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if not found:
        raise LockError(f"uv not found: pip install uv=={UV_VERSION} (or pass --install-uv)")
    return found


def _uv_version(uv: str) -> str:
    out = subprocess.run([uv, "--version"], capture_output=True, text=True, check=False).stdout.split()
    return out[1] if len(out) > 1 else "?"


def install_uv() -> None:
    try:
        if _uv_version(_uv()) == UV_VERSION:
            return
    except LockError:
        pass
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"uv=={UV_VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LockError(f"could not install uv {UV_VERSION}:\n{done.stderr.strip()}", status=3)


def _index_url() -> str:
    for var in ("UV_DEFAULT_INDEX", "UV_INDEX_URL"):
        if os.environ.get(var):
            return os.environ[var].rstrip("/")
    return "https://pypi.org/simple"


def probe_index(timeout: float = 20.0) -> None:
    """Fail fast, with a clear message, when the package index cannot be reached at all."""
    url = f"{_index_url()}/uv/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            pass
    except urllib.error.HTTPError:
        pass  # the index answered
    except (urllib.error.URLError, OSError) as exc:
        raise LockError(
            f"cannot reach the package index ({url}: {exc}); the GPU lock can only be resolved with PyPI", status=3
        ) from exc


def resolve(exclude_newer: str, constraints: str | None = None) -> str:
    """Run the lock's `uv pip compile` (to stdout), optionally constrained by a requirements file, and return
    its output."""
    uv = _uv()
    if _uv_version(uv) != UV_VERSION:
        print(f"gpu_lock: note: uv {_uv_version(uv)} here, the lock was made with uv {UV_VERSION}", file=sys.stderr)
    env = {**os.environ, "UV_HTTP_TIMEOUT": os.environ.get("UV_HTTP_TIMEOUT", "30")}
    try:
        done = subprocess.run(
            [uv, *compile_args(exclude_newer)[1:], *(["-c", constraints] if constraints else [])],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise LockError(f"uv pip compile did not finish in {TIMEOUT_S} s (is PyPI slow or unreachable?)", 3) from exc
    if done.returncode != 0:
        err = done.stderr.strip()
        if any(marker in err.lower() for marker in _NETWORK_ERRORS):
            raise LockError(f"cannot reach PyPI, so the GPU lock was not checked:\n{err}", status=3)
        raise LockError(f"the GPU requirements no longer resolve:\n{err}")
    return done.stdout


def update(exclude_newer: str | None) -> int:
    if exclude_newer is None and (REPO / LOCK).exists():
        exclude_newer = parse_exclude_newer((REPO / LOCK).read_text())
    if exclude_newer in (None, "today"):
        exclude_newer = f"{dt.datetime.now(dt.UTC).date().isoformat()}T00:00:00Z"
    probe_index()
    text = header(exclude_newer) + resolve(exclude_newer)
    (REPO / LOCK).write_text(text)
    pins = parse_pins(text)
    print(f"gpu_lock: wrote {LOCK}: {len(pins)} packages (exclude-newer {exclude_newer})")
    for name in ("torch", "megatron-core", "transformer-engine", "sglang", "flashinfer-python"):
        print(f"  {name}=={pins.get(name, '?')}")
    return 0


def check() -> int:
    text = (REPO / LOCK).read_text()
    exclude_newer = parse_exclude_newer(text)
    recorded = parse_command(text)
    if recorded != command_line(exclude_newer):
        raise LockError(
            f"{LOCK} was made by another command than tools/gpu_lock.py runs now:\n  lock:   {recorded}\n"
            f"  script: {command_line(exclude_newer)}\nregenerate it: python tools/gpu_lock.py --update"
        )
    probe_index()
    locked, fresh = parse_pins(text), parse_pins(resolve(exclude_newer))
    if locked == fresh:
        print(f"gpu_lock: {LOCK} resolves again to the same {len(locked)} packages (exclude-newer {exclude_newer})")
        return 0
    # The index can list releases dated before the cut-off that it did not serve when the lock was made
    # (upload times are the uploader's, mirrors catch up late). Whether the inputs changed is then told by
    # resolving with the lock's pins as constraints: unchanged inputs give exactly the lock again.
    try:
        pinned = parse_pins(resolve(exclude_newer, constraints=LOCK))
    except LockError as exc:
        if exc.status == 3:
            raise
        raise LockError(
            f"{LOCK} is stale: its pins no longer satisfy pyproject.toml and {INPUT} (changed?):\n{exc}\n"
            "regenerate it: python tools/gpu_lock.py --update"
        ) from exc
    if pinned != locked:
        raise LockError(
            f"{LOCK} is stale: pyproject.toml or {INPUT} changed what it must hold:\n"
            f"{_diff(locked, pinned, 'resolved now')}\nregenerate it: python tools/gpu_lock.py --update"
        )
    print(
        f"gpu_lock: {LOCK} still resolves to its {len(locked)} packages; the index now also lists newer releases "
        f"dated before the cut-off {exclude_newer} (move to them with --update):\n{_diff(locked, fresh, 'newer')}"
    )
    return 0


def _diff(locked: dict[str, str], other: dict[str, str], label: str) -> str:
    old = [f"{n}=={v}" for n, v in sorted(locked.items())]
    new = [f"{n}=={v}" for n, v in sorted(other.items())]
    return "\n".join(difflib.unified_diff(old, new, LOCK, label, lineterm="", n=0))


def installed() -> int:
    from importlib import metadata

    pins = parse_pins((REPO / LOCK).read_text())
    wrong = []
    for name, version in sorted(pins.items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = "missing"
        # A local build may carry a local version label (2.18.0+cu13...): compare the public part.
        if have.split("+")[0] != version.split("+")[0]:
            wrong.append(f"  {name}: lock {version}, installed {have}")
    if wrong:
        raise LockError("this environment differs from the GPU lock:\n" + "\n".join(wrong))
    print(f"gpu_lock: all {len(pins)} locked packages are installed at the locked versions")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--update", action="store_true", help="resolve on PyPI again and rewrite the lock")
    mode.add_argument("--check", action="store_true", help="resolve with the lock's cut-off date and compare")
    mode.add_argument("--installed", action="store_true", help="compare the running environment with the lock")
    parser.add_argument(
        "--exclude-newer", help="with --update: cut-off date, or 'today' (default: the lock's, else today 00:00 UTC)"
    )
    parser.add_argument("--install-uv", action="store_true", help=f"pip install uv=={UV_VERSION} first if needed")
    args = parser.parse_args(argv)
    try:
        if args.install_uv:
            install_uv()
        if args.update:
            return update(args.exclude_newer)
        if args.check:
            return check()
        return installed()
    except LockError as exc:
        print(f"gpu_lock: {exc}", file=sys.stderr)
        return exc.status


if __name__ == "__main__":
    sys.exit(main())
