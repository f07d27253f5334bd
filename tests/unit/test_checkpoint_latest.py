"""Which checkpoint a run resumes from when the checkpoints directory is damaged: never silently none."""

from __future__ import annotations

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
