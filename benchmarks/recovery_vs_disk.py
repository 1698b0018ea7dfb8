"""Benchmark `recovery-vs-disk`: run with `python benchmarks/recovery_vs_disk.py` (prints the ratio and its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "recovery-vs-disk", *sys.argv[1:]])
