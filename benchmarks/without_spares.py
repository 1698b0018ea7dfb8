"""Benchmark `without-spares`: run with `python benchmarks/without_spares.py` (recovery with no
warm spare, replacements forked from the agent's template, against restart-disk; prints the
ratios and their goals)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "without-spares", *sys.argv[1:]])
