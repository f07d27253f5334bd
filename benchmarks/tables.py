"""The dated tables of benchmarks/README.md, generated from their history in benchmarks/results/<table>.jsonl.

    python benchmarks/tables.py            rewrite every table of benchmarks/README.md from its JSONL file
    python benchmarks/tables.py --check    exit 1, naming the tables, when the README is not what the files give

Each JSONL line is one row of a table, its cells keyed by the table's column names in order (the first line's keys
are the header); a run is the rows sharing a date and a commit. The README shows the latest `KEEP_RUNS` runs of each
table, newest first, and says how many older rows the file holds. To record a run, append its rows to the table's
file (any order: runs are sorted by date, later lines first within a date) and run this script.

The tables sit between `<!-- table: NAME -->` and `<!-- /table -->` in the README; everything else there is
written by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
RESULTS = HERE / "results"
KEEP_RUNS = 2
BLOCK = re.compile(r"<!-- table: ([a-z0-9_-]+) -->\n.*?<!-- /table -->", re.DOTALL)


def read_rows(name: str) -> list[dict[str, str]]:
    path = RESULTS / f"{name}.jsonl"
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}: line {number}: not JSON ({exc})") from None
    if not rows:
        raise SystemExit(f"{path}: no rows")
    columns = list(rows[0])
    for number, row in enumerate(rows, 1):
        if list(row) != columns:
            raise SystemExit(f"{path}: row {number} has columns {list(row)}, the table's are {columns}")
    return rows


def newest_first(rows: list[dict[str, str]]) -> list[list[dict[str, str]]]:
    """The rows grouped into runs (same date and commit), newest date first, later runs first within a date."""
    runs: dict[tuple[str, str], list[dict[str, str]]] = {}
    for row in rows:
        runs.setdefault((row.get("date", ""), row.get("commit", "")), []).append(row)
    order = list(runs)
    return [runs[key] for key in sorted(order, key=lambda key: (key[0], order.index(key)), reverse=True)]


def render(name: str) -> str:
    rows = read_rows(name)
    columns = list(rows[0])
    runs = newest_first(rows)
    shown = [row for run in runs[:KEEP_RUNS] for row in run]
    numeric = [all(_numeric(row[c]) for row in rows if row[c]) and c not in ("date", "commit") for c in columns]
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---:" if right else "---" for right in numeric) + "|",
        *("| " + " | ".join(row[c] for c in columns) + " |" for row in shown),
    ]
    older = len(rows) - len(shown)
    if older:
        lines += ["", f"{older} older rows ({len(runs) - KEEP_RUNS} runs): `benchmarks/results/{name}.jsonl`."]
    return f"<!-- table: {name} -->\n" + "\n".join(lines) + "\n<!-- /table -->"


def _numeric(cell: str) -> bool:
    return bool(re.fullmatch(r"[-+]?[\d,]*\.?\d+(\s*[a-zA-Z%/]+)?", cell.strip()))


def rendered(text: str) -> str:
    return BLOCK.sub(lambda match: render(match.group(1)), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the README's tables are out of date")
    args = parser.parse_args(argv)
    text = README.read_text()
    new = rendered(text)
    if args.check:
        stale = [m.group(1) for m in BLOCK.finditer(text) if m.group(0) != render(m.group(1))]
        if stale:
            print(f"benchmarks/README.md: tables out of date: {', '.join(stale)} (run python benchmarks/tables.py)")
            return 1
        return 0
    if new != text:
        README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
