"""Rendering for the terminal and HTML: the only place in ffctl that imports rich."""
from __future__ import annotations

from rich.console import Console


def make_console(*, record: bool = False, quiet: bool = False, stderr: bool = False) -> Console:
    """The console every command draws on (callers never import rich themselves)."""
    return Console(record=record, quiet=quiet, stderr=stderr)
