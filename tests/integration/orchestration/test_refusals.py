"""`megatron-rl train` refusing to start: one line naming the file, row or field, a distinct exit status per kind
(config 2, data 3, sandbox 5, checkpoint 6), no traceback, and nothing written into the run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    command = [sys.executable, "-m", "megatron_rl.cli", "train", "--recipe", "scalerl-cpu", "name=refused"]
    return subprocess.run(
        [*command, f"output_dir={tmp_path / 'runs'}", *overrides], capture_output=True, text=True, env=env, timeout=300
    )


def _refused(done: subprocess.CompletedProcess, status: int, message: str) -> None:
    assert done.returncode == status, done.stdout[-3000:] + done.stderr[-3000:]
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len([line for line in done.stderr.splitlines() if line.startswith("megatron-rl:")]) == 1


@pytest.mark.parametrize(
    ("overrides", "status", "message"),
    [
        (["data.datasets=[{source: /nonexistent/rows.jsonl, task: math}]"], 3, "megatron-rl: data error: "),
        (["data.datasets=[{source: ROWS, task: math}]", "data.val_prompts=1"], 3, "megatron-rl: data error: "),
        (["data.datasets=[{source: DIR, task: math}]"], 3, "is a directory, not a data file"),
        (
            ["data.datasets=[{source: ROWS_OK, task: math}]", "data.val_prompts=1"],
            2,
            "megatron-rl: config error: trainer.warm_start_steps: the warm-up needs synthetic tasks",
        ),
    ],
    ids=["missing-dataset", "malformed-row", "directory-named-like-a-file", "warm-up-needs-synthetic-data"],
)
def test_a_refused_start_is_one_line_with_its_own_status_and_writes_nothing(tmp_path, overrides, status, message):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": 3}\n')
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(8)))
    (tmp_path / "dir.jsonl").mkdir()
    overrides = [
        o.replace("ROWS_OK", str(good)).replace("ROWS", str(rows)).replace("DIR", str(tmp_path / "dir.jsonl"))
        for o in overrides
    ]
    run_dir = tmp_path / "runs" / "refused"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("the earlier start's config\n")
    _refused(_train(tmp_path, *overrides), status, message)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]
    assert (run_dir / "config.yaml").read_text() == "the earlier start's config\n"


def test_an_output_dir_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    done = _train(tmp_path, f"output_dir={blocker / 'runs'}")
    _refused(done, 2, f"megatron-rl: config error: output_dir: {blocker} is not a directory")


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_before_anything_starts(tmp_path):
    """No Ray, no engine, no trainer: the damage is named in one line (exit 6) and the run directory is left as
    it was for the user to repair."""
    from megatron_rl.trainer.checkpoint import write_manifest

    run_dir = tmp_path / "runs" / "refused"
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    for name, content in {"megatron_rl.json": "{}", "run_state.pt": "x" * 100, "metadata.json": "{}"}.items():
        (checkpoint / name).write_text(content)
    write_manifest(checkpoint)
    (run_dir / "checkpoints" / "latest").write_text(checkpoint.name)
    (checkpoint / "run_state.pt").write_text("x" * 10)  # cut short
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    done = _train(tmp_path, "total_steps=2")
    _refused(done, 6, "megatron-rl: checkpoint error: ")
    assert "run_state.pt has 10 bytes, 100 were saved" in done.stderr
    assert "Ray" not in done.stdout + done.stderr
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == before
