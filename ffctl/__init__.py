"""ffctl: chaos testing and one-step recovery for distributed PyTorch training."""
from __future__ import annotations

__version__ = "0.1.0"
