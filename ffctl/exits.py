"""Errors the CLI turns into one line and an exit code (DESIGN.md, Conventions)."""
from __future__ import annotations

EXIT_OK = 0
EXIT_EXPECTATION = 1
EXIT_BAD_INPUT = 2
EXIT_INFRA = 3
# A batch script must not requeue the job: a requeue would fail the same way, or its requeues are
# spent (see docs/guides/hosts.md, Slurm).
EXIT_NO_REQUEUE = 4
# A run that completed while a fault it was asked for never took effect (its trigger never came,
# or it was held back until the end): a chaos check that tested nothing must not pass.
# `--allow-missed` accepts it (exit 0, the fault still recorded as missed).
EXIT_FAULT_MISSED = 5
EXIT_INTERRUPTED = 130


class BadInput(Exception):
    """Exit code 2: the message names the bad value, on one line whatever it quotes (a TOML
    parser's or a tool's message may carry line breaks; a user's value is quoted with repr)."""

    def __str__(self) -> str:
        return " ".join(part.strip() for part in super().__str__().splitlines() if part.strip())


class InfraError(Exception):
    """Exit code 3: a host, the controller or a tool could not be reached or used."""


class NoRequeue(Exception):
    """Exit code 4: nothing was started; a requeue would not help (the job's requeues are spent)."""
