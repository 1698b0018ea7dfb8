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


class StepRestart(PeerFailure):
    """The step was interrupted by a peer failure after which this rank has already joined the
    next generation and restored `step`: training goes on from `step` + 1."""

    def __init__(self, gen: int, step: int) -> None:
        super().__init__(gen, f"restart from step {step}")
        self.step = step
