"""Benchmark `control-plane`: run with `python benchmarks/control_plane.py [--nodes 8,64,256,1024]`
(a real controller and N simulated nodes, one lost: the recovery's control-plane phases per N;
prints them and the ratio of the largest size's recovery to the smallest's, with its goal)."""
from __future__ import annotations

import sys

from ffctl.cli.app import main

if __name__ == "__main__":
    main(["bench", "--only", "control-plane", *sys.argv[1:]])
