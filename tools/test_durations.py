"""tests/durations.json from a pytest log: each test file's seconds (setup, call and teardown summed).

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 | tee pytest.log
    python tools/test_durations.py pytest.log

tests/conftest.py hands the files to the pytest workers longest first (the classic longest-processing-time
schedule), so that no long file starts last while the other worker sits idle. The numbers only order the
files: a stale or missing entry costs balance, never a result. Files the log does not name keep their entry.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "durations.json"
LINE = re.compile(r"^\s*([\d.]+)s (?:setup|call|teardown)\s+(tests/\S+?\.py)::")


def file_seconds(log: str) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for line in log.splitlines():
        if match := LINE.match(line):
            seconds[match.group(2)] += float(match.group(1))
    return dict(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="a pytest log written with --durations=0")
    args = parser.parse_args(argv)
    measured = file_seconds(args.log.read_text(errors="replace"))
    if not measured:
        print(f"{args.log}: no duration lines (run pytest with --durations=0)", file=sys.stderr)
        return 1
    known = json.loads(OUT.read_text()) if OUT.exists() else {}
    known.update({name: round(seconds, 1) for name, seconds in measured.items()})
    existing = {name: seconds for name, seconds in known.items() if (ROOT / name).exists()}
    OUT.write_text(json.dumps(dict(sorted(existing.items())), indent=1) + "\n")
    print(f"{OUT.relative_to(ROOT)}: {len(measured)} files measured, {len(existing)} listed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
