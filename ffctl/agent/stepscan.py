r"""Steps read off a worker's console output: `ffctl launch --step-regex REGEX` for a script that
prints its progress (`step 12 loss 3.41`) but does not call `recovery.report_step`.

The agent follows each of its workers' logs from where the worker started writing, matches every
complete new line against the expression and reports the steps it finds, as the library would.
The expression names its step with a group `step` (or has it as its first group) and may name a
`loss` group. A worker's steps are reported in increasing order only: a line that repeats an
earlier step (a summary, a re-printed header) says nothing new.

Python's regular expressions backtrack, and a match cannot be interrupted: it holds the
interpreter, so one line that makes the expression backtrack for minutes freezes the agent (no
heartbeat: its node is declared lost). Two defences, since a time limit per match is not to be
had in-process: the shapes that backtrack exponentially or with a high power of the line's length
are refused up front with one line (`backtracking_hazard`: a quantifier inside a repeated group, an
alternation inside one, a backreference, three unbounded quantifiers in a row that can take the
same characters, a search's every start counting as one: `(a+)+`, `(a|a)*`, `.*(\d+)x`); and a
line is matched on its first MAX_LINE characters only, which keeps what remains (quantifiers kept
apart by literals, which an adversarial line can still repeat) to milliseconds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

try:
    import re._parser as _sre  # the parser `re` itself uses (Python >= 3.11)
except ImportError:  # pragma: no cover - older Pythons
    import sre_parse as _sre

# Longer lines are matched on their first MAX_LINE characters: a progress line is short, and the
# time the expressions that pass `backtracking_hazard` can take grows with a power of the length.
MAX_LINE = 1024
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
    why = backtracking_hazard(text)
    if why is not None:
        raise StepRegexError(f"--step-regex {text!r}: {why}, which can make one output line take the agent "
                             "minutes to match; write it without (e.g. 'step (?P<step>\\d+) loss (?P<loss>\\S+)')")
    return pattern


_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT}
_UNBOUNDED = 32  # a quantifier that may take more characters than this counts as unbounded
_CATEGORIES: dict[Any, Any] = {
    _sre.CATEGORY_DIGIT: str.isdigit, _sre.CATEGORY_SPACE: str.isspace,
    _sre.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
}
_NEGATED = {_sre.CATEGORY_NOT_DIGIT: _sre.CATEGORY_DIGIT, _sre.CATEGORY_NOT_SPACE: _sre.CATEGORY_SPACE,
            _sre.CATEGORY_NOT_WORD: _sre.CATEGORY_WORD}


def _chars(items: Any) -> set[str] | None:
    """The Latin-1 characters a one-character item takes (None: not such an item, or unknown)."""
    if len(items) != 1:
        return None
    op, av = items[0]
    every = [chr(i) for i in range(256)]
    if op is _sre.LITERAL:
        return {chr(av)}
    if op is _sre.NOT_LITERAL:
        return set(every) - {chr(av)}
    if op is _sre.ANY:
        return set(every) - {"\n"}
    if op is not _sre.IN:
        return None
    taken: set[str] = set()
    negate = False
    for kind, value in av:
        if kind is _sre.NEGATE:
            negate = True
        elif kind is _sre.LITERAL:
            taken.add(chr(value))
        elif kind is _sre.RANGE:
            taken |= {chr(i) for i in range(value[0], min(value[1], 255) + 1)}
        elif kind is _sre.CATEGORY and value in _CATEGORIES:
            taken |= {c for c in every if _CATEGORIES[value](c)}
        elif kind is _sre.CATEGORY and value in _NEGATED:
            taken |= {c for c in every if not _CATEGORIES[_NEGATED[value]](c)}
        else:
            return None
    return set(every) - taken if negate else taken


def _meets(a: set[str] | None, b: set[str] | None) -> bool:
    return a is None or b is None or bool(a & b)


def _hazard(items: Any, run: list[set[str] | None], in_repeat: bool) -> tuple[str | None, list[set[str] | None]]:
    """(what in `items` backtracks catastrophically, or None; the run after them). The run: the
    characters each unbounded quantifier since the last character every match must take can take
    (None: any). A new quantifier that shares characters with two of the run splits the same
    stretch of a line three ways: a cube of its length, tried again at every start."""
    for op, av in items:
        if op in _REPEATS:
            lo, hi, body = av
            if hi > 1 and in_repeat:
                return "a quantifier inside a repeated group", run
            why, _ = _hazard(body, [], in_repeat or hi > 1)
            if why:
                return why, run
            taken = _chars(body)
            if hi > _UNBOUNDED:
                if 1 + sum(_meets(taken, other) for other in run) >= 3:
                    return "unbounded quantifiers in a row that can take the same characters", run
                run = run + [taken]
            if lo > 0:
                # At least one of its characters sits between what comes before and after it.
                run = [other for other in run if _meets(taken, other)] if hi > _UNBOUNDED else []
        elif op is _sre.BRANCH:
            if in_repeat:
                return "an alternation inside a repeated group", run
            after: list[set[str] | None] = []
            for alt in av[1]:
                why, end = _hazard(alt, run, in_repeat)
                if why:
                    return why, run
                after += end
            run = after
        elif op is _sre.SUBPATTERN:
            why, run = _hazard(av[-1], run, in_repeat)
            if why:
                return why, run
        elif op in (_sre.GROUPREF, _sre.GROUPREF_EXISTS):
            return "a backreference", run
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            why, _ = _hazard(av[1], [], in_repeat)
            if why:
                return why, run
        elif op is _sre.AT:
            continue  # takes no character: what is on either side of it is still in a row
        else:
            run = []  # one character every match takes (or a part that never gives any back)
    return None, run


def backtracking_hazard(text: str) -> str | None:
    """Why `text` (a valid expression) can backtrack catastrophically, or None. A search tries
    every start of the line: as if the expression began with an unbounded quantifier of any
    character."""
    return _hazard(_sre.parse(text), [None], False)[0]


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
    """Follows one worker's logs (its stdout's, and its stderr's, where `logging` writes by
    default), each from its offset (its size when the worker started)."""

    def __init__(self, pattern: re.Pattern[str], logs: Sequence[tuple[Path, int]]) -> None:
        self.pattern = pattern
        self.logs = list(logs)
        self.offsets = [offset for _, offset in self.logs]
        self._partial = [b""] * len(self.logs)
        self.last_step = -1

    def poll(self) -> list[SeenStep]:
        """The new steps in lines completed since the last poll, in order (a step seen in one
        stream is not seen again in the other)."""
        seen: list[SeenStep] = []
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
            self._partial[i] = lines.pop()[-MAX_LINE:]  # an unfinished line waits for its end
            for raw in lines:
                found = parse_line(self.pattern, raw.decode("utf-8", errors="replace"))
                if found is not None and found.step > self.last_step:
                    self.last_step = found.step
                    seen.append(found)
        return seen
