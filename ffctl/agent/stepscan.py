"""Steps read off a worker's console output: `ffctl launch --step-regex REGEX` for a script that
prints its progress (`step 12 loss 3.41`) but does not call `recovery.report_step`.

The agent follows each of its workers' logs from where the worker started writing, matches every
complete new line against the expression and reports the steps it finds, as the library would.
The expression names its step with a group `step` (or has it as its first group) and may name a
`loss` group. A worker's steps are reported in increasing order only: a line that repeats an
earlier step (a summary, a re-printed header) says nothing new.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MAX_LINE = 4000  # longer lines are matched on their first MAX_LINE characters
READ_LIMIT = 1 << 20  # at most this much new output is read per poll: a flood cannot stall the agent


class StepRegexError(ValueError):
    """The expression cannot be used: the message names it and why."""


def compile_step_regex(text: str) -> re.Pattern[str]:
    """`text` compiled, with a step group; StepRegexError when it is not usable."""
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise StepRegexError(f"--step-regex {text!r}: not a regular expression ({exc})") from None
    if "step" not in pattern.groupindex and pattern.groups < 1:
        raise StepRegexError(f"--step-regex {text!r}: has no group for the step (write (?P<step>\\d+))")
    return pattern


@dataclass(frozen=True)
class SeenStep:
    step: int
    loss: float | None


def parse_line(pattern: re.Pattern[str], line: str) -> SeenStep | None:
    """The step (and loss) `line` reports, or None."""
    m = pattern.search(line[:MAX_LINE])
    if m is None:
        return None
    raw = m.group("step") if "step" in pattern.groupindex else m.group(1)
    if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > 18:
        return None
    loss: float | None = None
    if "loss" in pattern.groupindex and m.group("loss") is not None:
        try:
            loss = float(m.group("loss"))  # "nan" and "inf" too: a diverged loss is worth reporting
        except ValueError:
            loss = None
    return SeenStep(int(raw), loss)


class StepScanner:
    """Follows one worker's log from `offset` (its size when the worker started)."""

    def __init__(self, pattern: re.Pattern[str], log: Path, offset: int) -> None:
        self.pattern = pattern
        self.log = log
        self.offset = offset
        self._partial = b""
        self.last_step = -1

    def poll(self) -> list[SeenStep]:
        """The new steps in lines completed since the last poll, in order."""
        try:
            with open(self.log, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read(READ_LIMIT)
        except OSError:
            return []
        if not data:
            return []
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()[-MAX_LINE:]  # an unfinished line waits for its end
        seen = []
        for raw in lines:
            found = parse_line(self.pattern, raw.decode("utf-8", errors="replace"))
            if found is not None and found.step > self.last_step:
                self.last_step = found.step
                seen.append(found)
        return seen
