"""ffctl: chaos testing and one-step recovery for distributed PyTorch training."""
from __future__ import annotations

import warnings

# torch warns at import when numpy is missing, though nothing here converts tensors to numpy and
# numpy is not a dependency. Every entry point (the CLI, agents, spares, the built-in workload)
# imports this package before torch, so one narrow filter keeps the warning off every screen and log.
warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy: No module named 'numpy'",
                        category=UserWarning)

__version__ = "0.1.0"
