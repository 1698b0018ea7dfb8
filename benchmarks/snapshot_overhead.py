"""Benchmark `snapshot-overhead`: run with `python benchmarks/snapshot_overhead.py` (prints the ratio and its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "snapshot-overhead", *sys.argv[1:]])
