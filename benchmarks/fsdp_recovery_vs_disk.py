"""Benchmark `fsdp-recovery-vs-disk`: run with `python benchmarks/fsdp_recovery_vs_disk.py` (prints the ratio and its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "fsdp-recovery-vs-disk", *sys.argv[1:]])
