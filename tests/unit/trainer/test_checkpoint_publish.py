"""A save killed at any point of making a checkpoint current leaves `latest` naming a complete checkpoint,
and the next save removes what the killed one left behind.

The file-system half of save_checkpoint (begin_save, publish, sync_tree) runs here on plain directories:
a "checkpoint" is the required files plus a shard, each holding its step, so a checkpoint mixing two saves
or missing a file is told apart from a complete one. A kill is an exception raised at the n-th
rename / replace / rmtree (an rmtree killed midway has deleted one file), for every n until the save
completes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from megatron_rl.trainer.checkpoint import REQUIRED_FILES, begin_save, latest_checkpoint, publish, sync_tree

FILES = (*REQUIRED_FILES, "__0_0.distcp")


class Killed(BaseException):
    """The process dies here."""


def _write(path: Path, step: int, save: int = 0) -> Path:
    path.mkdir(parents=True)
    for name in FILES:
        (path / name).write_text(f"step {step}, save {save}")
    return path


def _is_complete(path: Path) -> bool:
    """Every file there, all from one save of the step the directory is named after."""
    if sorted(p.name for p in path.iterdir()) != sorted(FILES):
        return False
    contents = {(path / name).read_text() for name in FILES}
    return len(contents) == 1 and contents.pop().startswith(f"step {int(path.name.removeprefix('step_'))},")


def _kill_at(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Make the n-th rename / replace / rmtree call the last thing the process does."""
    calls = 0
    rename, replace, rmtree = Path.rename, os.replace, shutil.rmtree

    def counted(fn, partial: bool = False):
        def call(*args, **kwargs):
            nonlocal calls
            calls += 1
            if calls == n:
                if partial:  # an rmtree cut short: one file (a shard, the first the walk meets) is gone
                    shard = Path(args[0]) / FILES[-1]
                    if shard.exists():
                        shard.unlink()
                raise Killed
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(Path, "rename", counted(rename))
    monkeypatch.setattr(os, "replace", counted(replace))
    monkeypatch.setattr(shutil, "rmtree", counted(rmtree, partial=True))


@pytest.mark.parametrize("step", [4, 2], ids=["next step", "same step again"])
@pytest.mark.parametrize("keep_last", [1, 2])
def test_latest_names_a_complete_checkpoint_wherever_a_save_is_killed(tmp_path, monkeypatch, step, keep_last):
    name = f"step_{step:08d}"
    for n in range(1, 50):
        root = tmp_path / f"kill_{n}"
        _write(root / "step_00000001", 1)
        _write(root / "step_00000002", 2)
        if step != 2:  # a stray from a longer earlier run: pruning must not take the new checkpoint instead
            _write(root / "step_00000009", 9)
        (root / "latest").write_text("step_00000002")
        tmp = root / f".tmp_{name}"
        _write(tmp, step, save=1)
        with monkeypatch.context() as patch:
            _kill_at(patch, n)
            try:
                publish(root, tmp, name, keep_last)
                killed = False
            except Killed:
                killed = True
        for path in root.glob("step_*"):
            assert _is_complete(path), (n, path.name, sorted(p.name for p in path.iterdir()))
        named = root / (root / "latest").read_text()
        current = latest_checkpoint(root)
        assert current is not None and _is_complete(current)
        if named.exists():
            assert current == named
        else:
            # Only while the same step is saved again, between setting the old one aside and renaming the
            # new one in: resuming falls back to the newest other complete checkpoint, with a warning.
            assert step == 2 and current == root / "step_00000001"
        if not killed:
            names = sorted({name, *(p.name for p in root.glob("step_*"))})
            assert current == root / name and (current / FILES[0]).read_text().endswith("save 1")
            assert {p.name for p in root.glob("step_*")} == {name, *names[-keep_last:]}
            assert not list(root.glob(".tmp_*"))
            return
        # The next save starts from a clean slate: nothing a killed save left behind survives it.
        begin_save(root, root / ".tmp_step_00000010")
        assert [p.name for p in root.glob(".tmp_*")] == [".tmp_step_00000010"]
    raise AssertionError("publish never completed")


def test_a_save_cut_short_is_removed_by_the_next(tmp_path):
    _write(tmp_path / "step_00000002", 2)
    (tmp_path / "latest").write_text("step_00000002")
    (tmp_path / ".tmp_step_00000004").mkdir()
    (tmp_path / ".tmp_step_00000004" / "__0_0.distcp").write_text("half")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000002"  # never a candidate
    begin_save(tmp_path, tmp_path / ".tmp_step_00000004")
    assert list((tmp_path / ".tmp_step_00000004").iterdir()) == []
    assert _is_complete(tmp_path / "step_00000002") and (tmp_path / "latest").read_text() == "step_00000002"


def _record_fsyncs(monkeypatch: pytest.MonkeyPatch, events: list[tuple[str, str]]) -> None:
    fsync, rename, replace = os.fsync, Path.rename, os.replace

    def recorded_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_rename(self, target):
        events.append(("rename", str(target)))
        return rename(self, target)

    def recorded_replace(src, dst):
        events.append(("replace", str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(Path, "rename", recorded_rename)
    monkeypatch.setattr(os, "replace", recorded_replace)


def test_data_and_names_reach_the_disk_before_what_depends_on_them(tmp_path, monkeypatch):
    root = tmp_path.resolve()
    tmp = _write(root / ".tmp_step_00000004", 4)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "shard").write_text("x")
    events: list[tuple[str, str]] = []
    _record_fsyncs(monkeypatch, events)
    sync_tree(tmp)
    synced = {path for op, path in events if op == "fsync"}
    assert synced == {str(p) for p in [tmp, tmp / "sub", tmp / "sub" / "shard", *(tmp / n for n in FILES)]}

    events.clear()
    publish(root, tmp, "step_00000004", keep_last=2)
    final, latest = str(root / "step_00000004"), str(root / "latest")
    order = [(op, path) for op, path in events if (op, path) != ("fsync", str(root / ".latest.tmp"))]
    assert order[:3] == [("rename", final), ("fsync", str(root)), ("replace", latest)]
    assert ("fsync", str(root / ".latest.tmp")) in events[: events.index(("replace", latest))]
    assert events[events.index(("replace", latest)) + 1] == ("fsync", str(root))
