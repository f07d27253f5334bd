"""Whole-run tests share one small run (small_run.py); its folder is importable from the tests here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
