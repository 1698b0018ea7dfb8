r"""Steps read off a worker's console output: `ffctl launch --step-regex REGEX` for a script that
prints its progress (`step 12 loss 3.41`) but does not call `recovery.report_step`.

The agent follows each of its workers' logs from where the worker started writing, matches every
complete new line against the expression and reports the steps it finds, as the library would.
The expression names its step with a group `step` (or has it as its first group) and may name a
`loss` group. A worker's steps are reported in increasing order only: a line that repeats an
earlier step (a summary, a re-printed header) says nothing new.

The matching runs on the agent's own loop, between its heartbeats, so it must take bounded time
whatever a line holds. Python's `re` backtracks: one line can make an expression such as
`(?P<step>\d+)\s.*\s.*\s.*\s.*Z` take minutes, a match cannot be interrupted (it holds the
interpreter, so a timer thread never runs), a process per match is far too slow, and no check of
an expression's shape tells the slow ones from the rest. So `re` only parses the expression here
(its group names, and the syntax users know); every match is made by RE2 (the `google-re2`
package, module `re2`), an automaton engine whose time is linear in the line's length for any
expression it accepts. The price: RE2 has no backreferences and no lookaround (`\1`, `(?=...)`,
`(?<=...)`), which are refused with one line, and its `\d`, `\s`, `\w` and `\b` are ASCII only
(steps must be ASCII digits anyway). Three caps make "linear" a small number:

- MAX_LINE: a line is matched on its first 4,096 characters (its head: where a progress line
  says its step); the rest of a longer line is never looked at.
- MAX_PROGRAM: RE2's time per character grows with the size of the compiled expression, so an
  expression of more than 256 RE2 instructions (a realistic one has 20 to 100) is refused. With
  both caps the slowest line found (expressions made to defeat RE2's fast path, at the size cap)
  takes a few tens of milliseconds; a usual one takes microseconds.
- POLL_BUDGET_S: one poll matches lines for at most this long; the lines it did not reach wait,
  in order, for the next poll (no new output is read before they are done), so a flood of lines
  delays steps but never stalls the loop.
"""
from __future__ import annotations

import functools
import importlib
import re
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# The head of a longer line is matched (a progress line is short); the time a match takes grows
# with the length of what is matched.
MAX_LINE = 4096
# RE2 instructions an expression may compile to: the other factor of a match's worst-case time.
MAX_PROGRAM = 256
READ_LIMIT = 1 << 20  # at most this much new output is read per poll: a flood cannot stall the agent
POLL_BUDGET_S = 0.2  # matching time per scanner per poll; what is left waits for the next poll
ENGINE = "google-re2"  # the package that provides the `re2` module


class StepRegexError(ValueError):
    """The expression cannot be used: the message names it and why."""


def _re2() -> Any:
    """The RE2 binding, or None where the package is not installed."""
    try:
        return importlib.import_module("re2")
    except ImportError:
        return None


def _why_re2(exc: BaseException) -> str:
    """RE2's message for a refused expression (it gives bytes), as text."""
    arg = exc.args[0] if exc.args else exc
    return arg.decode("utf-8", errors="replace") if isinstance(arg, bytes) else str(arg)


@functools.lru_cache(maxsize=32)
def _bounded(pattern: re.Pattern[str]) -> Any:
    """`pattern` compiled by RE2 (cached: each worker's scanner shares it); StepRegexError when RE2
    cannot match it in bounded time."""
    text = pattern.pattern
    engine = _re2()
    if engine is None:
        raise StepRegexError(f"--step-regex {text!r}: needs the {ENGINE} package (the engine that matches it "
                             f"in bounded time), which is not installed: pip install {ENGINE}")
    # Flags given to re.compile rather than written inline (compile_step_regex gives none).
    inline = "".join(c for flag, c in ((re.IGNORECASE, "i"), (re.MULTILINE, "m"), (re.DOTALL, "s"))
                     if pattern.flags & flag)
    options = engine.Options()
    options.log_errors = False  # the refusal below is the one line; RE2 would log its own too
    try:
        compiled = engine.compile(f"(?{inline}){text}" if inline else text, options)
    except (engine.error, UnicodeError) as exc:
        raise StepRegexError(f"--step-regex {text!r}: not usable with RE2, the engine that matches it in bounded "
                             f"time ({_why_re2(exc)}); it has no backreferences, lookaround or verbose mode") from None
    if compiled.programsize > MAX_PROGRAM:
        raise StepRegexError(f"--step-regex {text!r}: too large ({compiled.programsize} RE2 instructions, at most "
                             f"{MAX_PROGRAM}: a larger one makes each line slow to match)")
    if compiled.groupindex != pattern.groupindex or compiled.groups != pattern.groups:
        raise StepRegexError(f"--step-regex {text!r}: its groups read differently in RE2; name the step's group "
                             "(?P<step>...)")
    return compiled


def compile_step_regex(text: str) -> re.Pattern[str]:
    """`text` compiled, with a step group; StepRegexError when it is not usable. Python's pattern
    names the groups; `parse_line` matches with its RE2 twin, which this checks exists."""
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise StepRegexError(f"--step-regex {text!r}: not a regular expression ({exc})") from None
    if "step" not in pattern.groupindex and pattern.groups < 1:
        raise StepRegexError(f"--step-regex {text!r}: has no group for the step (write (?P<step>\\d+))")
    _bounded(pattern)
    return pattern


@dataclass(frozen=True)
class SeenStep:
    step: int
    loss: float | None


def parse_line(pattern: re.Pattern[str], line: str) -> SeenStep | None:
    """The step (and loss) `line` reports, or None: its first MAX_LINE characters matched by RE2,
    in time linear in their length."""
    head = line[:MAX_LINE]
    matcher = _bounded(pattern)
    try:
        m = matcher.search(head)
    except UnicodeError:  # a lone surrogate (RE2 matches UTF-8): read as the replacement character
        m = matcher.search(head.encode("utf-8", errors="replace").decode("utf-8"))
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
    """Follows one worker's logs (its stdout's, and its stderr's, where `logging` writes by
    default), each from its offset (its size when the worker started)."""

    def __init__(self, pattern: re.Pattern[str], logs: Sequence[tuple[Path, int]]) -> None:
        _bounded(pattern)  # refused here, not on the first line, if RE2 cannot take it
        self.pattern = pattern
        self.logs = list(logs)
        self.offsets = [offset for _, offset in self.logs]
        self._partial = [b""] * len(self.logs)
        self._pending: deque[bytes] = deque()  # complete lines (their heads) not matched yet
        self.last_step = -1

    def _read(self) -> None:
        """The lines completed since the last read, each cut to its head, onto the pending ones."""
        for i, (log, _) in enumerate(self.logs):
            try:
                with open(log, "rb") as fh:
                    fh.seek(self.offsets[i])
                    data = fh.read(READ_LIMIT)
            except OSError:
                continue
            if not data:
                continue
            self.offsets[i] += len(data)
            lines = (self._partial[i] + data).split(b"\n")
            # An unfinished line waits for its end; only its head is kept, the part that is matched.
            self._partial[i] = lines.pop()[:MAX_LINE]
            # An empty line cannot hold a step (the step group needs a digit).
            self._pending.extend(raw[:MAX_LINE] for raw in lines if raw)

    def poll(self) -> list[SeenStep]:
        """The new steps in lines completed since the last poll, in order (a step seen in one
        stream is not seen again in the other), matched for at most POLL_BUDGET_S: lines left
        over are matched first on the next poll."""
        if not self._pending:
            self._read()
        seen: list[SeenStep] = []
        deadline = time.monotonic() + POLL_BUDGET_S
        while self._pending and time.monotonic() < deadline:
            raw = self._pending.popleft()
            found = parse_line(self.pattern, raw.decode("utf-8", errors="replace"))
            if found is not None and found.step > self.last_step:
                self.last_step = found.step
                seen.append(found)
        return seen
