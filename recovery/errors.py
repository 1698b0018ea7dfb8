"""Exceptions the recovery library raises to its caller."""
from __future__ import annotations


class RecoveryError(Exception):
    """Recovery cannot continue (no usable state, controller gone); the rank must exit."""


class PeerFailure(Exception):
    """A collective of the current generation failed or was aborted by the controller."""

    def __init__(self, gen: int, reason: str) -> None:
        super().__init__(f"generation {gen}: {reason}")
        self.gen = gen
        self.reason = reason
