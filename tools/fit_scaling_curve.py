"""Thin script over `megatron-rl fit` (see megatron_rl/scaling/cli.py)."""

import sys

from megatron_rl.scaling.cli import main

if __name__ == "__main__":
    sys.exit(main())
