"""Benchmark `scale`: run with `python benchmarks/scale.py` (prints the ratio and its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "scale", *sys.argv[1:]])
