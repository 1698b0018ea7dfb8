"""How a plan's commands reach a host: the `Transport` protocol and the local implementation.

Commands are argv lists, never shell strings; a transport that needs a shell (SSH) quotes every
word, so no host name, path or target can inject shell.
"""
from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable


class TransportError(Exception):
    """The host could not be reached or the command could not be started."""


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        err = (self.stderr or self.stdout).strip().splitlines()
        return f"`{shlex.join(self.argv)}` exited {self.returncode}" + (f": {err[-1]}" if err else "")


@runtime_checkable
class Transport(Protocol):
    """Runs argv on one host (or one network namespace of this host)."""

    host: str

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        """Run to completion; a non-zero exit is a value, not an exception."""
        ...

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        """Start argv so that it survives this process and the connection (dead man's switch)."""
        ...


class LocalTransport:
    """This machine, optionally inside a network namespace (`ip netns exec NAME ...`)."""

    def __init__(self, host: str = "localhost", netns: str | None = None) -> None:
        self.host = host
        self.netns = netns

    def _wrap(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        full = self._wrap(argv)
        try:
            proc = subprocess.run(
                full, input=input, capture_output=True, text=True, timeout=timeout, check=False
            )
        except FileNotFoundError as exc:
            return CommandResult(tuple(argv), 127, "", f"{exc.filename}: command not found")
        except subprocess.TimeoutExpired:
            return CommandResult(tuple(argv), 124, "", f"timed out after {timeout:g}s")
        return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        try:
            subprocess.Popen(
                self._wrap(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # outlives a SIGKILLed ffctl and its process group
                close_fds=True,
            )
        except OSError as exc:
            raise TransportError(f"cannot start {argv[0]!r} on {self.host}: {exc}") from None
