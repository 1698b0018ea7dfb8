"""`python -m ffctl.sim`: the simulated-agent process (see `ffctl.sim.agents`)."""
from __future__ import annotations

import sys

from ffctl.sim.agents import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
