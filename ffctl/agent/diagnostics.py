"""Where the agent's and the worker template's diagnostics go: their stderr, one line each,
exactly as the message says it (no level, time or logger name is added, so what a user sees
of an agent is what it always printed).

Diagnostics are for whoever reads an agent's output; the run's facts travel as messages to the
controller and become events in the record. Only the `ffctl` loggers are configured, never the
root logger: the template's forked workers run the user's script, whose own
`logging.basicConfig` must behave as it does under `python SCRIPT`.
"""
from __future__ import annotations

import logging
import sys

LOGGER = "ffctl"


def to_stderr() -> logging.Handler:
    """Send the `ffctl` loggers' diagnostics (warnings and up) to this process's stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    return handler


def detach(handler: logging.Handler) -> None:
    """Undo `to_stderr` (in a forked worker, whose logging is its script's)."""
    logger = logging.getLogger(LOGGER)
    logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)
