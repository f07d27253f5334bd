"""A run's directory as the driver meets it: writable before the start, its last checkpoint named in every message
that tells the user how to go on, and a full file system told apart from other write failures."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.trainer.checkpoint import latest_checkpoint


def check_writable(run_dir: Path) -> None:
    """The run directory exists and is writable, or can be created (its nearest existing ancestor is writable)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is not a directory" if not existing.is_dir() else "is not writable"
        raise ConfigError(f"output_dir: {existing} {what}, so the run directory {run_dir} cannot be written")


def last_checkpoint(run_dir: Path) -> str:
    """Where the run can resume from, as a phrase."""
    last = latest_checkpoint(run_dir / "checkpoints")
    return f"the last complete checkpoint is {last}" if last else "no checkpoint was written yet"


def out_of_space(path: Path, exc: BaseException) -> str | None:
    """Why a write under `path` failed when the file system is full, else None. The error a save raises in a trainer
    rank rarely says so (torch's checkpoint writer wraps the OSError, Ray wraps that again), so the file system is
    asked too: full when it has less free space than the newest checkpoint takes (what the save needed), or none."""
    text = f"{exc!r} {exc}"
    mount = path if path.exists() else path.parent
    usage = shutil.disk_usage(mount)
    newest = max((p for p in path.glob("step_*") if p.is_dir()), default=None) if path.exists() else None
    needed = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) if newest is not None else 0
    if "No space left on device" in text or "Errno 28" in text or usage.free < max(needed, 1 << 20):
        size = lambda n: f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"  # noqa: E731
        return f"no space left on device ({size(usage.free)} free of {size(usage.total)} at {mount})"
    return None
