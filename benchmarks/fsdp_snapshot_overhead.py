"""Benchmark `fsdp-snapshot-overhead`: run with `python benchmarks/fsdp_snapshot_overhead.py` (prints the ratio and its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "fsdp-snapshot-overhead", *sys.argv[1:]])
