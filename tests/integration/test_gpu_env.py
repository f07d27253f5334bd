"""The GPU lock (env/gpu-requirements.lock) against the versions the code pins and the packages' own requirements.

Offline: the repository's files plus the metadata of the CPU install, where tools/install.sh puts the same
megatron-core and sglang releases (their declared requirements do not depend on the machine). Whether the lock
still resolves on PyPI is tools/gpu_lock.py --check, a step of .ci/run.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _fake_apptainer(tmp_path: Path) -> Path:
    fake = tmp_path / "apptainer"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "$FAKE_LOG"\n')
    fake.chmod(0o755)
    return fake


def test_setup_script_runs_the_programs_in_the_image(tmp_path):
    image = tmp_path / "mrl.sif"
    image.touch()
    log = tmp_path / "calls"
    env = {
        **os.environ,
        "MRL_IMAGE": str(image),
        "MRL_APPTAINER": str(_fake_apptainer(tmp_path)),
        "MRL_SRC": str(REPO),
        "FAKE_LOG": str(log),
        "TMPDIR": str(tmp_path),
    }
    setup = REPO / "env/mrl_setup_apptainer.sh"
    script = f"set -euo pipefail; source {setup}; ray start --head; python -c pass; megatron-rl"
    subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, check=True, timeout=30)
    calls = log.read_text().splitlines()
    binds = f"--bind {tmp_path} --bind {tmp_path} --bind {REPO}:/opt/megatron_rl"
    assert calls == [
        f"exec --nv --pwd {tmp_path} {binds} {image} /opt/mrl/venv/bin/ray start --head",
        f"exec --nv --pwd {tmp_path} {binds} {image} /opt/mrl/venv/bin/python -c pass",
        f"exec --nv --pwd {tmp_path} {binds} {image} /opt/mrl/venv/bin/megatron-rl",
    ]


def test_setup_script_needs_an_image(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MRL_IMAGE"}
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source {REPO}/env/mrl_setup_apptainer.sh; echo started"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0 and "started" not in done.stdout and "MRL_IMAGE" in done.stderr
