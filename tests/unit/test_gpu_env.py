"""The GPU lock (env/gpu-requirements.lock) against the versions the code pins and the packages' own requirements.

Offline: the repository's files plus the metadata of the CPU install, where tools/install.sh puts the same
megatron-core and sglang releases (their declared requirements do not depend on the machine). Whether the lock
still resolves on PyPI is tools/gpu_lock.py --check, a step of .ci/run.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _load_gpu_lock():
    spec = importlib.util.spec_from_file_location("gpu_lock", REPO / "tools" / "gpu_lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_lock = _load_gpu_lock()
LOCK_TEXT = (REPO / gpu_lock.LOCK).read_text()
PINS = gpu_lock.parse_pins(LOCK_TEXT)
# Environment markers of a GPU node: linux x86_64, CPython 3.12.
GPU_NODE = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}


def _shell_var(path: str, name: str) -> str:
    match = re.search(rf"^{name}=([^\s#]+)", (REPO / path).read_text(), re.M)
    assert match, f"{path} no longer sets {name}"
    return match.group(1).strip("\"'")


def _applies(req: Requirement, extras: tuple[str, ...] = ()) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**GPU_NODE, "extra": extra}) for extra in ("", *extras))


def _unmet(reqs: list[Requirement]) -> list[str]:
    problems = []
    for req in reqs:
        name = gpu_lock.normalize(req.name)
        if name not in PINS:
            problems.append(f"{req}: not in the lock")
        elif not req.specifier.contains(PINS[name], prereleases=True):
            problems.append(f"{req}: the lock has {PINS[name]}")
    return problems


def _installed_requirements(name: str, extras: tuple[str, ...] = ()) -> list[Requirement]:
    """Requirements (for a GPU node) declared by the CPU install's copy of the locked release of `name`."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{name} is not installed here: run tools/install.sh (it installs the locked release)")
    if dist.version != PINS[name]:
        pytest.fail(
            f"{name} {dist.version} is installed here, the lock has {PINS[name]}: install.sh and the lock disagree"
        )
    return [req for req in map(Requirement, dist.requires or []) if _applies(req, extras)]


def test_header_records_the_command_the_script_runs():
    exclude_newer = gpu_lock.parse_exclude_newer(LOCK_TEXT)
    assert gpu_lock.parse_command(LOCK_TEXT) == gpu_lock.command_line(exclude_newer)
    assert gpu_lock.PYTHON_VERSION == "3.12"  # megatron-core >= 0.17 declares Python >= 3.12
    assert len(PINS) > 100 and all(name == gpu_lock.normalize(name) for name in PINS)


def test_megatron_core_is_the_one_install_sh_installs():
    assert PINS["megatron-core"] == _shell_var("tools/install.sh", "MCORE_VERSION")


def test_sglang_is_the_one_install_sglang_sh_installs():
    assert PINS["sglang"] == _shell_var("tools/install_sglang.sh", "SGLANG_VERSION")


def test_cpu_torch_pins_agree():
    # The CPU machines' torch (the local CPU wheel) differs from the GPU lock's on purpose: sglang fixes the latter.
    cpu = _shell_var("tools/install.sh", "TORCH_VERSION")
    constraint = (REPO / "tools/constraints.txt").read_text()
    assert f"torch=={cpu}" in constraint.split()


def test_lock_holds_the_pins_of_its_input():
    for line in (REPO / gpu_lock.INPUT).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            assert req.specifier.contains(PINS[gpu_lock.normalize(req.name)]), req


def test_lock_satisfies_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in gpu_lock.EXTRAS:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    assert _unmet([r for r in reqs if _applies(r)]) == []


def test_torch_is_the_one_sglang_requires():
    torch = [r for r in _installed_requirements("sglang") if gpu_lock.normalize(r.name) == "torch"]
    assert [str(r.specifier) for r in torch] == [f"=={PINS['torch']}"]


def test_lock_satisfies_sglang():
    assert _unmet(_installed_requirements("sglang")) == []


def test_lock_satisfies_megatron_core_and_its_te_extra():
    reqs = _installed_requirements("megatron-core", extras=("te",))
    assert "transformer-engine" in {gpu_lock.normalize(r.name) for r in reqs}
    assert _unmet(reqs) == []


def test_transformer_engine_pieces_are_one_release_for_cuda_13():
    te = PINS["transformer-engine"]
    assert PINS["transformer-engine-torch"] == te and PINS["transformer-engine-cu13"] == te
    assert "transformer-engine-cu12" not in PINS


def test_transformer_engine_passes_every_megatron_core_feature_gate():
    """megatron-core switches TE features on with is_te_min_version("X"): the locked TE passes all of them."""
    try:
        files = metadata.distribution("megatron-core").files or []
    except metadata.PackageNotFoundError:
        pytest.fail("megatron-core is not installed here: run tools/install.sh")
    gates = set()
    for file in files:
        if file.suffix == ".py" and file.parts[:2] == ("megatron", "core"):
            gates.update(re.findall(r"is_te_min_version\(\s*[\"']([^\"']+)[\"']", file.read_text()))
    assert gates, "no is_te_min_version gates found in megatron-core"
    newest = max(Version(g) for g in gates)
    assert Version(PINS["transformer-engine"]) >= newest


def test_one_cuda_version_across_lock_and_images():
    runtime = Version(PINS["nvidia-cuda-runtime"])
    assert runtime.major == 13 and f"transformer-engine-cu{runtime.major}" in PINS
    assert Version(PINS["cuda-toolkit"]).release[:2] == runtime.release[:2]
    docker = re.search(r"^FROM (nvidia/cuda:(\d+)\.(\d+)\.\d+-\S+)$", (REPO / "env/Dockerfile").read_text(), re.M)
    assert docker, "env/Dockerfile no longer starts from an nvidia/cuda image"
    assert (int(docker.group(2)), int(docker.group(3))) == runtime.release[:2]
    definition = (REPO / "env/megatron_rl.def").read_text()
    assert re.search(rf"^From: {re.escape(docker.group(1))}$", definition, re.M), "the .def and Dockerfile differ"
    for text in ((REPO / "env/Dockerfile").read_text(), definition):
        assert f"python{gpu_lock.PYTHON_VERSION}-dev" in text


def test_install_script_builds_only_the_source_only_packages():
    script = (REPO / "env/install_gpu.sh").read_text()
    for name in gpu_lock.SOURCE_ONLY:
        assert name in PINS and f"grep -v '^{name}=='" in script


def _fake_apptainer(tmp_path: Path) -> Path:
    fake = tmp_path / "apptainer"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$*" >> "$FAKE_LOG"\n')
    fake.chmod(0o755)
    return fake


def test_the_image_builds_apex_exactly_when_the_config_says_so():
    """config.GPU_IMAGE_HAS_APEX decides whether the gradient-accumulation fusion can be on: it must describe the
    image (the lock, the Dockerfile and the Apptainer definition)."""
    from megatron_rl.config import GPU_IMAGE_HAS_APEX

    recipes = " ".join(
        (REPO / "env" / name).read_text() for name in ("Dockerfile", "megatron_rl.def", "install_gpu.sh")
    )
    builds_apex = "NVIDIA/apex" in recipes or "fused_weight_gradient_mlp_cuda" in recipes
    assert "apex" not in PINS  # PyPI's `apex` is an unrelated project: never in the lock
    assert builds_apex == GPU_IMAGE_HAS_APEX
