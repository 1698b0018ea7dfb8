"""Benchmark `replacement-start`: run with `python benchmarks/replacement_start.py` (prints the ratio
of a worker's start-up forked from the agent's template to a fresh interpreter's, and its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "replacement-start", *sys.argv[1:]])
