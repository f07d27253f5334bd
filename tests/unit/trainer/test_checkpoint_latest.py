"""Which checkpoint a run resumes from when the checkpoints directory is damaged: never silently none."""

from __future__ import annotations

import json

import pytest

from megatron_rl.trainer.checkpoint import REQUIRED_FILES, CheckpointError, latest_checkpoint


def _checkpoint(root, step: int, complete: bool = True):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    for name in REQUIRED_FILES if complete else REQUIRED_FILES[:1]:
        (path / name).write_text("x")
    return path


def test_latest_names_the_checkpoint(tmp_path):
    _checkpoint(tmp_path, 2)
    four = _checkpoint(tmp_path, 4)
    (tmp_path / "latest").write_text(four.name)
    assert latest_checkpoint(tmp_path) == four
    assert latest_checkpoint(tmp_path / "nothing_here") is None


def test_a_damaged_latest_falls_back_to_the_newest_complete_one(tmp_path, capsys):
    two = _checkpoint(tmp_path, 2)
    four = _checkpoint(tmp_path, 4, complete=False)  # e.g. run_state.pt deleted by hand
    (tmp_path / "latest").write_text(four.name)
    assert latest_checkpoint(tmp_path) == two
    assert "lacks run_state.pt, metadata.json; resuming from step_00000002" in capsys.readouterr().out

    (tmp_path / "latest").write_text("step_00000006")  # names a directory that is gone
    assert latest_checkpoint(tmp_path) == two


def test_no_complete_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    _checkpoint(tmp_path, 2, complete=False)
    with pytest.raises(CheckpointError, match="no other checkpoint .* is complete"):
        latest_checkpoint(tmp_path)


def _saved(root, step: int):
    """A checkpoint as save_checkpoint leaves it: the required files, a model shard and the manifest, last."""
    from megatron_rl.trainer.checkpoint import write_manifest

    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "megatron_rl.json").write_text(json.dumps({"step": step, "manifest": "manifest.json"}))
    (path / "run_state.pt").write_bytes(bytes(range(256)) * 40)
    (path / "metadata.json").write_text("{}")
    (path / "__0_0.distcp").write_bytes(b"\x01" * 100_000)
    write_manifest(path)
    return path


def _manifest_deleted_and_shard_cut(path):
    """Nothing left to check the shards against: the checkpoint cannot be trusted (megatron would fail deep inside its
    load with a long traceback on the cut shard)."""
    (path / "manifest.json").unlink()
    (path / "__0_0.distcp").write_bytes(b"\x01" * 50_000)


def test_a_checkpoint_from_before_manifests_is_judged_by_its_files(tmp_path):
    old = _checkpoint(tmp_path, 2)  # megatron_rl.json without a manifest stamp, no manifest
    (tmp_path / "latest").write_text(old.name)
    assert latest_checkpoint(tmp_path) == old


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (
            lambda p: (p / "__0_0.distcp").write_bytes(b"\x01" * 50_000),
            "__0_0.distcp has 50000 bytes, 100000 were saved",
        ),
        (lambda p: (p / "run_state.pt").write_bytes((p / "run_state.pt").read_bytes()[:1000]), "run_state.pt has 1000"),
        (lambda p: (p / "megatron_rl.json").write_text(""), "megatron_rl.json has 0 bytes"),
        (lambda p: (p / "run_state.pt").write_bytes(bytes(reversed(range(256))) * 40), "run_state.pt differs"),
        (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp missing"),
        (_manifest_deleted_and_shard_cut, "manifest.json missing (its save wrote one)"),
    ],
    ids=["truncated-shard", "cut-run-state", "empty-json", "changed-run-state", "missing-shard", "no-manifest"],
)
def test_a_damaged_newest_checkpoint_is_named_and_the_newest_intact_one_used(tmp_path, capsys, damage, named):
    from megatron_rl.trainer.checkpoint import damaged

    two, four = _saved(tmp_path, 2), _saved(tmp_path, 4)
    (tmp_path / "latest").write_text(four.name)
    assert latest_checkpoint(tmp_path) == four and damaged(four) == []
    damage(four)
    assert latest_checkpoint(tmp_path) == two
    out = capsys.readouterr().out
    assert f"names {four.name}, which" in out and named in out and "resuming from step_00000002" in out
    damage(two)
    with pytest.raises(CheckpointError) as info:
        latest_checkpoint(tmp_path)
    assert named in str(info.value) and "step_00000002: " in str(info.value)


def test_the_starting_model_is_the_one_of_the_runs_first_start(tmp_path):
    """A resume that finds its starting policy elsewhere (a warm-up cached under new inputs) keeps the record of the
    policy the run started from: `megatron-rl eval --start` compares against that one."""
    from megatron_rl.trainer.checkpoint import record_starting_model, starting_model

    first, later = tmp_path / "warm-a", tmp_path / "warm-b"
    first.mkdir()
    later.mkdir()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    record_starting_model(run, first)
    record_starting_model(run, later)  # the resume's start
    assert starting_model(run / "checkpoints" / "step_00000004") == first.resolve()
