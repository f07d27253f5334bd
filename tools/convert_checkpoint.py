"""Thin script over `megatron-rl convert` (see megatron_rl/convert/cli.py): --from-hf / --to-hf."""

import sys

from megatron_rl.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
