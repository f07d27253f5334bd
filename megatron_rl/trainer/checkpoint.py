"""Checkpoints: megatron-core distributed checkpointing of model + optimizer, plus the run's own state.

Layout of `<run_dir>/checkpoints/`:

    step_00000100/            one checkpoint (a megatron-core dist_checkpointing directory)
        ...                   sharded tensors: {"model": GPTModel.sharded_state_dict(),
                              "optimizer": the optimizer's sharded state (dp_reshardable)}
        megatron_rl.json      {"step", "model": ModelConfig as a dict, "parallel": {...}}
        run_state.pt          whatever the driver registers (sampler, curriculum, pipeline counters)
                              plus the trainer's step counters and RNG states
    latest                    the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary directory (`.tmp_step_...`), flushed to disk, and renamed
when every rank has finished, so a crash mid-save never leaves a half checkpoint behind `latest`; the next
save removes the temporary directories a killed save left. Because the tensors are saved sharded by
global shape, a checkpoint written under one TP/PP/EP/DP layout loads under another (megatron-core
reshards); convert/ exports them to Hugging Face.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and megatron-core load with the trainer; the driver reads manifests without them
    from megatron_rl.trainer.step import Trainer

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


REQUIRED_FILES = ("megatron_rl.json", "run_state.pt", "metadata.json")
"""What every complete checkpoint holds (metadata.json: megatron-core's dist_checkpointing index)."""
TMP_PREFIX = ".tmp_"
"""Directories under the checkpoints root that are not (or no longer) checkpoints: a save in progress or cut
short, a checkpoint being replaced or pruned. `latest` never names one; the next save removes them."""


STARTING_MODEL = "starting_model.json"
"""In a run directory: the Hugging Face directory the run started from (config.json, tokenizer, chat template), so
that an export of any of its checkpoints carries a loadable tokenizer (`convert --to-hf`)."""


def record_starting_model(run_dir: Path, hf_dir: Path) -> None:
    """Records the HF directory the run started from, at its first start: a resume keeps the record (its starting
    policy may since be built elsewhere, as a warm-up cached under new inputs)."""
    record = run_dir / STARTING_MODEL
    if not record.exists():
        record.write_text(json.dumps({"path": str(Path(hf_dir).resolve())}) + "\n")


def starting_model(checkpoint: Path) -> Path | None:
    """The HF directory the run of `checkpoint` (`<run>/checkpoints/step_N`, or the checkpoint root) started
    from, when the run recorded it and the directory is still there."""
    for run_dir in (checkpoint.parent.parent, checkpoint.parent):
        record = run_dir / STARTING_MODEL
        if record.is_file():
            path = Path(json.loads(record.read_text())["path"])
            return path if path.is_dir() else None
    return None


class CheckpointError(RuntimeError):
    """The checkpoints directory cannot be resumed from as it is."""


MANIFEST = "manifest.json"
"""Written last into a checkpoint: every file with its size, and a checksum of each file up to
`CHECKSUM_MAX_BYTES` (the run's own state, the indexes, the RNG states), so a truncated shard, a cut
run_state.pt or an emptied megatron_rl.json is found before the run trusts it. Sizes alone for the large
model and optimizer shards: reading a Scout checkpoint's shards back to hash them would cost minutes per save."""
CHECKSUM_MAX_BYTES = 64 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(path: Path) -> None:
    """Record every file under the checkpoint directory `path` (rank 0, once every rank's files are on disk)."""
    files: dict[str, dict[str, Any]] = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        size = file.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= CHECKSUM_MAX_BYTES:
            entry["sha256"] = _sha256(file)
        files[str(file.relative_to(path))] = entry
    (path / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n")


def damaged(path: Path) -> list[str]:
    """What is wrong with the checkpoint at `path`, file by file (empty when it can be trusted): required files
    missing, and against its manifest, files missing, of another size or another checksum. A checkpoint from
    before manifests is judged by its required files alone."""
    lacking = incomplete(path)
    problems = [f"lacks {', '.join(lacking)}"] if lacking else []
    manifest = path / MANIFEST
    if not manifest.is_file():
        if _saved_with_manifest(path):  # deleted since: nothing left to check the shards against
            problems.append(f"{MANIFEST} missing (its save wrote one)")
        return problems
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [*problems, f"{MANIFEST} unreadable"]
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            if name not in lacking:
                problems.append(f"{name} missing")
        elif file.stat().st_size != entry["size"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, {entry['size']} were saved")
        elif "sha256" in entry and _sha256(file) != entry["sha256"]:
            problems.append(f"{name} differs from what was saved (checksum)")
    return sorted(set(problems), key=problems.index)


def _saved_with_manifest(path: Path) -> bool:
    """Whether the save of `path` wrote a manifest (its megatron_rl.json says so; older saves did not)."""
    try:
        return json.loads((path / "megatron_rl.json").read_text()).get("manifest") == MANIFEST
    except (OSError, ValueError, AttributeError):
        return False


def incomplete(path: Path) -> list[str]:
    """The files a complete checkpoint has and `path` lacks (empty when complete)."""
    return [name for name in REQUIRED_FILES if not (path / name).is_file()]


def latest_checkpoint(root: Path) -> Path | None:
    """The newest intact checkpoint under `root`, or None when there is none at all.

    `latest` names it. If what it names is missing, incomplete or damaged (`damaged`: files deleted, truncated
    or changed since the save, a copy cut short), the newest intact `step_*` directory is used instead, with a
    warning naming the damage; if checkpoints exist but none is intact, CheckpointError naming each one's
    damage: a run must never silently start over, nor resume from a checkpoint it cannot trust."""
    root = Path(root)
    marker = root / "latest"
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    if not marker.exists() and not steps:
        return None
    named = root / marker.read_text().strip() if marker.exists() else None
    damage = damaged(named) if named is not None and named.is_dir() else []
    if named is not None and named.is_dir() and not damage:
        return named
    problem = (
        f"{marker} names {named.name}, which " + ("does not exist" if not named.is_dir() else "; ".join(damage))
        if named is not None
        else f"{marker} is missing"
    )
    found = {}
    for path in steps:
        found[path.name] = damaged(path) if path != named else damage
        if not found[path.name]:
            print(f"checkpoint: {problem}; resuming from {path.name}, the newest complete one", flush=True)
            return path
    others = "; ".join(
        f"{name}: {', '.join(items)}" for name, items in found.items() if name != getattr(named, "name", None)
    )
    raise CheckpointError(
        f"{problem}, and no other checkpoint under {root} is complete and intact ({others or 'there is none'}): "
        "restore the directory, or move it away to start the run afresh"
    )


def _sharded_state(trainer: Trainer, is_loading: bool, model_only: bool = False) -> dict[str, Any]:
    model_state = trainer.model.sharded_state_dict()
    if model_only:
        return {"model": model_state}
    optimizer_state = trainer.optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata=OPTIMIZER_METADATA
    )
    return {"model": model_state, "optimizer": optimizer_state}


def _in_process_write_results() -> None:
    """Megatron's writer hands its write results over a queue that, by default, is a `multiprocessing` Manager
    queue served by a process it spawns at the first save (a fresh interpreter that imports the Ray worker's
    main: ~0.3 GB of host memory per trainer rank, for the rest of the run). That queue exists for async saves,
    whose writes run in another process; `save_checkpoint` saves synchronously, so the writes and the read of
    their results both happen in this process and a plain in-process queue carries them."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(trainer: Trainer, root: Path, run_state: dict[str, Any], keep_last: int = 2) -> Path:
    """Save model, optimizer and `run_state` as `root/step_<step>`; all trainer ranks call it."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.config import to_dict

    _in_process_write_results()

    root = Path(root)
    name = f"step_{trainer.step:08d}"
    tmp = root / f"{TMP_PREFIX}{name}"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        begin_save(root, tmp)
    _barrier()
    if not trainer.optimizer_has_state:
        _initialise_optimizer_state(trainer)
    dist_checkpointing.save(_sharded_state(trainer, is_loading=False), str(tmp))
    torch.save({"torch_rng": torch.get_rng_state()}, tmp / f"rng_rank{rank:05d}.pt")
    if rank == 0:
        torch.save(
            {"trainer": {"step": trainer.step, "skipped_steps": trainer.skipped_steps}, "run": run_state},
            tmp / "run_state.pt",
        )
        meta = {
            "step": trainer.step,
            "model": dataclasses.asdict(trainer.run.model),
            "parallel": dataclasses.asdict(trainer.run.parallel),
            "params_dtype": trainer.run.trainer.params_dtype,
            "run": to_dict(trainer.run),  # the resolved config a resume is compared with (orchestration/resume.py)
            "data_fingerprints": run_state.get("data_fingerprints"),
            "manifest": MANIFEST,  # written last: a checkpoint whose manifest is gone is damaged, not old
        }
        (tmp / "megatron_rl.json").write_text(json.dumps(meta, indent=2))
    # On disk before the rename: after a node loss the rename (and `latest`) can survive while the data they
    # name does not, leaving empty or truncated files behind a name that says complete. Every rank flushes,
    # since on a shared file system each node's unwritten pages are its own; on one node the first rank
    # flushes and the others find nothing left to write.
    sync_tree(tmp)
    _barrier()
    if rank == 0:  # last: every rank's files are on disk, and the manifest records what they are
        write_manifest(tmp)
        sync_tree(tmp)
    final = publish(root, tmp, name, keep_last) if rank == 0 else root / name
    _barrier()
    return final


def begin_save(root: Path, tmp: Path) -> None:
    """Rank 0, before a save: remove what saves cut short by a kill left behind, and make `tmp`."""
    for stale in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)


def publish(root: Path, tmp: Path, name: str, keep_last: int) -> Path:
    """Rank 0, once `tmp` is complete and on disk: rename it to `root/name`, point `latest` at it, prune.

    Each step is durable (fsync of the renamed directory's parent) before the next depends on it: on a node
    loss a rename can survive while the data it names, or an earlier rename, does not. Directories on their
    way out are first renamed to `.tmp_*` names, so a kill mid-delete never leaves a partial `step_*`
    directory that looks like a checkpoint."""
    final = root / name
    replaced = root / f"{TMP_PREFIX}replaced_{name}"
    if final.exists():  # the same step saved again: `latest` may name it, so set it aside, never half-delete it
        final.rename(replaced)
    tmp.rename(final)
    _fsync_dir(root)
    marker_tmp = root / ".latest.tmp"
    with open(marker_tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(marker_tmp, root / "latest")
    _fsync_dir(root)
    shutil.rmtree(replaced, ignore_errors=True)
    old = sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep_last] if keep_last > 0 else []
    for path in old:
        if path != final:
            doomed = root / f"{TMP_PREFIX}pruned_{path.name}"
            path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    return final


def sync_tree(path: Path) -> None:
    """fsync every file under `path`, then every directory (deepest first), so their entries are durable."""
    dirs = []
    for here, _, files in os.walk(path):
        dirs.append(here)
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for here in reversed(dirs):
        _fsync_dir(Path(here))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(trainer: Trainer, path: Path, model_only: bool = False) -> dict[str, Any]:
    """Restore model, optimizer and trainer counters from `path`; returns the driver's run state.

    The model loads under any TP/PP/EP/DP layout. The optimizer state is saved dp-reshardable: it
    resumes under a different data-parallel size but the same TP/PP/EP; to change those, load with
    `model_only=True` (weights and counters, fresh optimizer state).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.trainer.optimizer import apply_hyperparameters, restore_adam_steps, retarget_saved_groups

    path = Path(path)
    if not (path / "run_state.pt").exists():
        raise FileNotFoundError(f"{path}: not a megatron_rl checkpoint (run_state.pt missing)")
    meta = json.loads((path / "megatron_rl.json").read_text())
    saved_model, model = meta["model"], dataclasses.asdict(trainer.run.model)
    differs = [k for k in ("num_layers", "hidden_size", "vocab_size", "family") if saved_model.get(k) != model[k]]
    if differs:
        raise ValueError(
            f"{path}: checkpoint model differs from the configured one in "
            + ", ".join(f"{k} (checkpoint {saved_model.get(k)!r}, config {model[k]!r})" for k in differs)
        )
    saved_parallel, parallel = meta["parallel"], dataclasses.asdict(trainer.run.parallel)
    moved = [k for k in ("tp", "pp", "ep") if saved_parallel[k] != parallel[k]]
    if moved and not model_only:
        raise ValueError(
            f"{path}: saved with {', '.join(f'{k}={saved_parallel[k]}' for k in moved)} but configured with "
            f"{', '.join(f'{k}={parallel[k]}' for k in moved)}; the optimizer state cannot be resharded across "
            "TP/PP/EP: load with model_only=True (fresh optimizer state) or use the saved layout"
        )
    if not model_only and not trainer.optimizer_has_state:
        _initialise_optimizer_state(trainer)
    state = dist_checkpointing.load(_sharded_state(trainer, is_loading=True, model_only=model_only), str(path))
    with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
        trainer.model.load_state_dict(state["model"])
        if not model_only:
            retarget_saved_groups(state["optimizer"], trainer.run.trainer.optimizer)
            trainer.optimizer.load_state_dict(state["optimizer"])
            restore_adam_steps(trainer.optimizer)
            apply_hyperparameters(trainer.optimizer, trainer.run.trainer.optimizer)  # a resume may change them
        else:
            trainer.optimizer.reload_model_params()
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng_rank{rank:05d}.pt"
    if rng_file.exists():
        torch.set_rng_state(torch.load(rng_file, weights_only=False)["torch_rng"])
    saved = torch.load(path / "run_state.pt", weights_only=False)
    trainer.step = saved["trainer"]["step"]
    trainer.skipped_steps = saved["trainer"]["skipped_steps"]
    return saved["run"]


def _initialise_optimizer_state(trainer: Trainer) -> None:
    """A fresh optimizer has no Adam state to load into: take one step with zero gradients and lr 0."""
    lrs = [group["lr"] for group in trainer.optimizer.param_groups]
    for group in trainer.optimizer.param_groups:
        group["lr"] = 0.0
    trainer.ddp.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    for param in trainer.model.parameters():
        if getattr(param, "main_grad", None) is not None:
            param.main_grad.zero_()
    trainer.optimizer.step()
    for group, lr in zip(trainer.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    trainer.optimizer_has_state = True
