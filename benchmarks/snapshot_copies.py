"""Benchmark `snapshot-copies`: run with `python benchmarks/snapshot_copies.py` (prints the ratio and its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "snapshot-copies", *sys.argv[1:]])
