"""The sweep's loop and state file: how each run ended (finished, crashed with its exit code, stalled, stopped by the
rule), resume from a state file, and refusals of a state that belongs to another sweep.

The runs here are scripted: a launcher that appends one metrics row per poll instead of training, with the fault
each test injects (a crash, a hang). Real runs: tests/integration/scaling/test_sweep.py."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from megatron_rl.scaling.sweep import (
    STATE_FILE,
    Interrupted,
    Progress,
    RunState,
    SweepError,
    fit_progress,
    load_state,
    load_sweep,
    outcome,
    read_progress,
    resume_action,
    run_sweep,
    save_state,
)
from megatron_rl.scaling.sweep_cli import main as sweep_main
from megatron_rl.scaling.synthetic import synthetic_curve


class Scripted:
    """Each run is a list of metrics rows, one appended per poll; then it exits with `end` (an int) or hangs
    (`end` = "hang": no more rows, never exits until stopped). A stopped run exits 0 at the next poll."""

    def __init__(self, plans: dict[str, tuple[list[dict], int | str]], alive: set[str] | None = None) -> None:
        self.plans = plans
        self.written: dict[str, int] = {}
        self.signals: list[tuple[str, bool]] = []
        self.launched: list[str] = []
        self.attached: list[str] = []
        self.alive_runs = alive or set()
        self.directory: Path | None = None

    def log(self, state, directory):
        return directory / "logs" / f"{state.name}.log"

    def describe(self, state):
        return "scripted"

    def launch(self, spec, state, directory):
        self.directory = directory
        self.launched.append(state.name)
        path = directory / state.name / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(json.dumps({"run": {"name": state.name}}) + "\n")
        self.written.setdefault(state.name, 0)

    def alive(self, state):
        return state.name in self.alive_runs

    def attach(self, state):
        self.attached.append(state.name)

    def poll(self, state):
        if any(name == state.name for name, _ in self.signals):
            return 0
        rows, end = self.plans[state.name]
        i = self.written.setdefault(state.name, 0)
        if i < len(rows):
            assert self.directory is not None
            with (self.directory / state.name / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(rows[i]) + "\n")
            self.written[state.name] = i + 1
            return False
        return False if end == "hang" else end

    def stop(self, state, kill=False):
        self.signals.append((state.name, kill))


def _rows(A: float, steps: int, seed: int) -> list[dict]:
    """One evaluation per step, device-hours = step / 10, on a synthetic curve."""
    compute, R = synthetic_curve(A, 1.5, 0.5, noise=0.004, seed=seed, points=steps, max_compute=steps / 10)
    return [
        {"step": i, "device_hours": float(c), "val/pass_rate": float(r)}
        for i, (c, r) in enumerate(zip(compute, R, strict=True))
    ]


def _sweep(tmp_path: Path, runs: dict[str, int], **extra):
    data = {
        "recipe": "scalerl-cpu",
        "runs": [{"name": name, "overrides": {"total_steps": steps}} for name, steps in runs.items()],
        "launcher": {"kind": "local", "parallel": len(runs)},
        "fit": {"bootstrap": 50, "min_points": 4},
        "poll_s": 0.1,
        "stall_timeout_s": 1,
        **extra,
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_sweep(path)


def test_finished_crashed_and_stalled_runs_are_told_apart_and_the_sweep_goes_on(tmp_path):
    sweep = _sweep(tmp_path, {"ok": 6, "crash": 6, "hangs": 6})
    launcher = Scripted({"ok": (_rows(0.7, 6, 1), 0), "crash": (_rows(0.7, 2, 2)[:2], 3), "hangs": ([], "hang")})
    lines: list[str] = []
    runs = run_sweep(sweep, tmp_path / "sw", launcher, say=lines.append)
    assert runs["ok"].status == "finished" and runs["ok"].reason == "6 of 6 steps"
    assert runs["crash"].status == "crashed" and runs["crash"].exit_code == 3
    assert runs["crash"].reason == "exit code 3 at step 1 of 6"
    assert runs["hangs"].status == "stalled" and runs["hangs"].reason.startswith("stalled: no new metrics for ")
    assert launcher.signals == [("hangs", False)]  # only the stalled run was signalled, once, gracefully
    saved = json.loads((tmp_path / "sw" / STATE_FILE).read_text())["runs"]
    assert {name: entry["status"] for name, entry in saved.items()} == {
        "ok": "finished",
        "crash": "crashed",
        "hangs": "stalled",
    }
    assert "crash: crashed: exit code 3 at step 1 of 6" in lines


def test_the_rule_stops_the_loser_with_its_numbers_and_the_leader_runs_on(tmp_path):
    sweep = _sweep(tmp_path, {"high": 12, "low": 40}, stopping={"rule": "halving", "min_evals": 5})
    launcher = Scripted({"high": (_rows(0.8, 12, 1), 0), "low": (_rows(0.45, 40, 2), 0)})
    runs = run_sweep(sweep, tmp_path / "sw", launcher, say=lambda line: None)
    assert runs["high"].status == "finished"
    low = runs["low"]
    assert low.status == "stopped" and low.stop["kind"] == "rule" and low.stop["leader"] == "high"
    assert low.stop["diff_lo"] > 0.0 and 5 <= low.last_step < 40
    assert low.reason.startswith("stop low: leader high A ") and low.reason.endswith(
        f"(at step {low.last_step} of 40, exit code 0)"
    )
    assert launcher.signals == [("low", False)]


def test_resume_skips_ended_runs_attaches_live_ones_and_relaunches_the_rest(tmp_path):
    sweep = _sweep(tmp_path, {"done": 4, "live": 4, "gone": 4, "new": 4, "broke": 4})
    directory = tmp_path / "sw"
    directory.mkdir()
    earlier = load_state(directory, sweep)
    earlier["done"].status, earlier["done"].reason = "finished", "4 of 4 steps"
    earlier["live"].status, earlier["live"].pid = "running", 4242
    earlier["gone"].status = "running"
    earlier["broke"].status, earlier["broke"].exit_code = "crashed", 3
    save_state(directory, sweep, earlier)
    rows = _rows(0.7, 4, 1)
    launcher = Scripted({name: (rows, 0) for name in ("live", "gone", "new")}, alive={"live"})
    launcher.directory = directory
    (directory / "live").mkdir()
    (directory / "live" / "metrics.jsonl").write_text(json.dumps({"run": {}}) + "\n")
    runs = run_sweep(sweep, directory, launcher, say=lambda line: None)
    assert launcher.attached == ["live"] and sorted(launcher.launched) == ["gone", "new"]
    assert runs["done"].status == "finished" and runs["broke"].status == "crashed"
    assert all(runs[n].status == "finished" for n in ("live", "gone", "new"))
    # --retry-failed launches the crashed run again
    launcher = Scripted({"broke": (rows, 0)})
    runs = run_sweep(sweep, directory, launcher, retry_failed=True, say=lambda line: None)
    assert launcher.launched == ["broke"] and runs["broke"].status == "finished"


@pytest.mark.parametrize(
    ("status", "alive", "retry", "action"),
    [
        ("finished", False, True, "skip"),
        ("stopped", True, True, "skip"),
        ("crashed", False, False, "skip"),
        ("crashed", False, True, "launch"),
        ("stalled", False, False, "skip"),
        ("running", True, False, "attach"),
        ("running", False, False, "launch"),
        ("interrupted", False, False, "launch"),
        ("pending", False, False, "launch"),
    ],
)
def test_resume_action(status, alive, retry, action):
    state = RunState("r", [], "scalerl-cpu", None, 10, status=status)
    assert resume_action(state, alive, retry) == action


def test_outcome_of_an_ended_process():
    state = RunState("r", [], "scalerl-cpu", None, 10)
    assert outcome(state, 0, Progress(last_step=10)) == ("finished", "10 of 10 steps")
    assert outcome(state, None, Progress(last_step=10)) == ("finished", "10 of 10 steps")
    assert outcome(state, 2, Progress(last_step=0)) == ("crashed", "exit code 2 at step 0 of 10")
    assert outcome(state, 0, Progress(last_step=4))[0] == "interrupted"
    assert outcome(state, None, Progress(last_step=4))[1].startswith("ended at step 4 of 10; exit code unknown")
    state.stop = {"kind": "rule", "why": "stop r: ..."}
    assert outcome(state, 0, Progress(last_step=4)) == ("stopped", "stop r: ... (at step 4 of 10, exit code 0)")
    assert outcome(state, 0, Progress(last_step=10))[0] == "finished"  # the stop came after its last step
    state.stop = {"kind": "stall", "why": "stalled: no new metrics for 31 s (stall_timeout_s)"}
    assert outcome(state, 143, Progress(last_step=4))[0] == "stalled"


def test_a_state_file_of_another_sweep_is_refused(tmp_path):
    sweep = _sweep(tmp_path, {"a": 4})
    directory = tmp_path / "sw"
    directory.mkdir()
    state = load_state(directory, sweep)
    state["a"].overrides = ["total_steps=8"]
    save_state(directory, sweep, state)
    with pytest.raises(SweepError, match=r"run a was launched with recipe scalerl-cpu, overrides \['total_steps=8'\]"):
        load_state(directory, sweep)
    state["b"] = RunState("b", [], "scalerl-cpu", None, 4)
    state["a"].overrides = ["total_steps=4"]
    save_state(directory, sweep, state)
    with pytest.raises(SweepError, match="run b is not in .* any more"):
        load_state(directory, sweep)
    (directory / STATE_FILE).write_text("{")
    with pytest.raises(SweepError, match="not a sweep state file"):
        load_state(directory, sweep)


class Interrupting(Scripted):
    """Scripted runs, and the sweep itself gets SIGTERM at its `at`-th poll of a run (the fault injected)."""

    def __init__(self, plans, at: int) -> None:
        super().__init__(plans)
        self.polls, self.at = 0, at

    def poll(self, state):
        self.polls += 1
        if self.polls == self.at:
            raise Interrupted(signal.SIGTERM)
        return super().poll(state)


def test_an_interrupted_sweep_stops_its_runs_gracefully_and_the_next_one_relaunches_them(tmp_path):
    sweep = _sweep(tmp_path, {"a": 6, "b": 6})
    launcher = Interrupting({"a": (_rows(0.7, 6, 1), 0), "b": (_rows(0.6, 6, 2), 0)}, at=5)
    with pytest.raises(Interrupted):
        run_sweep(sweep, tmp_path / "sw", launcher, say=lambda line: None)
    assert sorted(launcher.signals) == [("a", False), ("b", False)]  # SIGTERM each, nothing killed
    saved = json.loads((tmp_path / "sw" / STATE_FILE).read_text())["runs"]
    assert {n: (e["status"], e["reason"]) for n, e in saved.items()} == {
        "a": ("interrupted", "the sweep was interrupted"),
        "b": ("interrupted", "the sweep was interrupted"),
    }
    again = Scripted({"a": (_rows(0.7, 6, 1), 0), "b": (_rows(0.6, 6, 2), 0)})
    runs = run_sweep(sweep, tmp_path / "sw", again, say=lambda line: None)
    assert sorted(again.launched) == ["a", "b"] and all(s.status == "finished" for s in runs.values())
    assert all(s.launches == 2 for s in runs.values())


def test_the_command_lists_the_runs_of_a_sweep_file_and_refuses_a_bad_one_in_one_line(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"recipe": "scalerl-cpu", "axes": {"total_steps": [5, 10]}}))
    assert sweep_main([str(good), "--check", "--dir", str(tmp_path / "sw")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"sweep {good}: 2 runs, launcher local (parallel 1), rule none; directory {tmp_path / 'sw'}"
    assert out[1:] == ["  total_steps-5: --recipe scalerl-cpu total_steps=5 (5 steps)",
                       "  total_steps-10: --recipe scalerl-cpu total_steps=10 (10 steps)"]  # fmt: skip
    assert not (tmp_path / "sw").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"recipe": "scalerl-cpu", "axes": {"total_stepz": [5]}}))
    assert sweep_main([str(bad), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"megatron-rl sweep: {bad}: axes.total_stepz: total_stepz: unknown field of RunConfig")
    assert err.count("\n") == 1


def test_the_live_fit_follows_a_replaced_value_of_the_last_step(tmp_path):
    # The final evaluation is a second row of the last step: its value replaces the step's, with no new point.
    sweep = _sweep(tmp_path, {"a": 6})
    rows = _rows(0.7, 6, 1)
    final = {**rows[-1], "val/pass_rate": rows[-1]["val/pass_rate"] + 0.05}
    lines: list[str] = []
    run_sweep(sweep, tmp_path / "sw", Scripted({"a": ([*rows, final], 0)}), say=lines.append)
    progress = read_progress(tmp_path / "sw" / "a" / "metrics.jsonl")
    assert progress.evals[-1][2] == final["val/pass_rate"] and progress.relogged == 0
    fit = fit_progress("a", progress, "a", sweep.fit)
    assert lines[-1].startswith("a finished 6/6 ") and f"A={fit.fit.A:.3f}" in lines[-1], lines[-1]


class Refusing(Scripted):
    """Scripted runs whose launch of `refused` fails, as sbatch refusing a job does (the fault injected)."""

    def __init__(self, plans, refused: str) -> None:
        super().__init__(plans)
        self.refused = refused

    def launch(self, spec, state, directory):
        if state.name == self.refused:
            raise RuntimeError(f"sbatch for {state.name} failed (exit code 1): sbatch: error: Invalid partition\n")
        super().launch(spec, state, directory)


def test_a_run_that_cannot_be_launched_is_named_and_the_others_go_on(tmp_path):
    sweep = _sweep(tmp_path, {"a": 6, "b": 6})
    lines: list[str] = []
    runs = run_sweep(sweep, tmp_path / "sw", Refusing({"b": (_rows(0.7, 6, 1), 0)}, "a"), say=lines.append)
    reason = "not launched: sbatch for a failed (exit code 1): sbatch: error: Invalid partition"
    assert (runs["a"].status, runs["a"].reason, runs["a"].launches) == ("crashed", reason, 0)
    assert runs["b"].status == "finished" and f"a: {reason}" in lines
