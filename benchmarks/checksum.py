"""Benchmark `checksum`: run with `python benchmarks/checksum.py` (prints the ratio of a large
snapshot's checksum on the library's threads to one pass, and its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "checksum", *sys.argv[1:]])
