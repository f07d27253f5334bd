"""The metrics file of a run that died between checkpoints: resuming keeps each step once."""

from __future__ import annotations

import json

from megatron_rl.config import LoggingConfig
from megatron_rl.metrics import MetricsLogger, read_metrics

CFG = LoggingConfig(wandb="disabled", console_every_steps=0)


def _write(path, steps: list[int], torn: bool = False) -> None:
    lines = [json.dumps({"run": {"name": "first"}})] + [json.dumps({"step": s, "train/loss": s / 10}) for s in steps]
    path.write_text("\n".join(lines) + "\n" + ('{"step": 7, "train/lo' if torn else ""))


def test_rows_after_the_checkpoint_and_a_torn_line_are_dropped(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write(run_dir / "metrics.jsonl", [1, 2, 3, 4, 5, 6], torn=True)  # killed after step 6, checkpoint at 4
    logger = MetricsLogger(CFG, run_dir, {"name": "second"}, {}, resume_step=4)
    logger.log(5, {"train/loss": 0.55})
    logger.close()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[-1]["train/loss"] == 0.55
    header = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert header == {"run": {"name": "first"}}  # the run continues under its first header
    out = capsys.readouterr().out
    assert "2 rows after step 4 dropped" in out and "metrics.jsonl:8: not JSON" in out


def test_a_run_started_again_from_scratch_replaces_the_old_rows(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _write(run_dir / "metrics.jsonl", [1, 2])  # died before its first checkpoint
    MetricsLogger(CFG, run_dir, {"name": "second"}, {}, resume_step=0).close()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert lines == [json.dumps({"run": {"name": "second"}})]
