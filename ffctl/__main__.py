"""`python -m ffctl`: the same as the `ffctl` console script."""
from __future__ import annotations

from ffctl.cli.app import main

if __name__ == "__main__":
    main()
