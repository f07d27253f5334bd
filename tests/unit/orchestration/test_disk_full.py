"""A full disk ends a run with one line that says so, not a traceback of whatever write failed first: the error a
checkpoint save raises in a trainer rank has lost its errno (torch's checkpoint writer and Ray wrap it), so the file
system is asked."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest

from megatron_rl import cli
from megatron_rl.orchestration import run_dir, train

Usage = namedtuple("Usage", "total used free")


def test_a_wrapped_save_failure_on_a_full_file_system_is_named(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    (root / "step_00000002").mkdir(parents=True)
    (root / "step_00000002" / "shard").write_bytes(b"x" * 5_000_000)  # what the next save needs, about
    wrapped = RuntimeError("Worker failure: An error is caught while starting worker 0, error: <class 'RuntimeError'>")
    assert run_dir.out_of_space(root, wrapped) is None  # this file system has room: not a disk problem
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9 - 3_000_000, 3_000_000))
    assert run_dir.out_of_space(root, wrapped) == f"no space left on device (3.0 MB free of 1.00 GB at {root})"
    monkeypatch.undo()
    full = OSError(errno.ENOSPC, "No space left on device")
    assert run_dir.out_of_space(root, RuntimeError(f"save failed: {full}")).startswith("no space left on device")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_train_ends_in_one_line_on_a_full_disk(tmp_path, monkeypatch, capsys, code):
    def full(run):
        raise OSError(code, "disk full")

    monkeypatch.setattr(train, "train", full)
    status = cli.main(["train", "--recipe", "scalerl-cpu", f"output_dir={tmp_path}", "name=r"])
    err = capsys.readouterr().err
    assert status == cli.EXIT_CODES["filesystem"] and err.count("\n") == 1, err
    assert err.startswith("megatron-rl: filesystem error: ") and f"writing {tmp_path / 'r'}" in err
    monkeypatch.setattr(train, "train", lambda run: (_ for _ in ()).throw(OSError(errno.EACCES, "denied")))
    with pytest.raises(PermissionError):  # other OS errors are not dressed up as a full disk
        cli.main(["train", "--recipe", "scalerl-cpu", f"output_dir={tmp_path}", "name=r"])
