"""benchmarks/README.md's dated tables are what their history files give (benchmarks/tables.py), and a run appended
to a history file shows at the top of its table, the oldest run leaving the README for the file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("benchmark_tables", ROOT / "benchmarks" / "tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


def test_the_readme_tables_are_generated_from_the_history_files():
    assert tables.main(["--check"]) == 0, "run python benchmarks/tables.py"
    names = [m.group(1) for m in tables.BLOCK.finditer(tables.README.read_text())]
    assert sorted(names) == sorted(p.stem for p in tables.RESULTS.glob("*.jsonl"))


def test_a_new_run_goes_on_top_and_the_oldest_moves_to_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    rows = [
        {"date": "2026-01-02", "commit": "b", "case": "x", "seconds": "2.0"},
        {"date": "2026-01-01", "commit": "a", "case": "x", "seconds": "1.0"},
        {"date": "2026-01-01", "commit": "a", "case": "y", "seconds": "1.5"},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert tables.render("t").splitlines()[3:6] == [
        "| 2026-01-02 | b | x | 2.0 |",
        "| 2026-01-01 | a | x | 1.0 |",
        "| 2026-01-01 | a | y | 1.5 |",
    ]
    with path.open("a") as f:  # a later run of the same day, appended last
        f.write(json.dumps({"date": "2026-01-02", "commit": "c", "case": "x", "seconds": "3.0"}) + "\n")
    text = tables.render("t")
    assert text.splitlines()[1:5] == ["| date | commit | case | seconds |", "|---|---|---|---:|",
                                      "| 2026-01-02 | c | x | 3.0 |", "| 2026-01-02 | b | x | 2.0 |"]  # fmt: skip
    assert "2 older rows (1 runs): `benchmarks/results/t.jsonl`." in text
