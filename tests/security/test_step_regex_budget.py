"""`--step-regex` against lines made to stall it: a step expression that backtracks polynomially in
Python's `re` (`(?P<step>\\d+)\\s.*\\s.*\\s.*\\s.*Z`, which a check of shapes let through) is matched
by the agent in bounded time on a 4,096-character line built to make it backtrack, lines keep their
head, a flood of lines waits for the next poll, and what the bounded engine cannot take is refused
with one line. The timed matching runs in a child process, so a matcher that stalls fails the test
at its deadline instead of holding the suite for minutes."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ffctl.agent import stepscan
from ffctl.agent.stepscan import MAX_LINE, StepRegexError, StepScanner, compile_step_regex, parse_line
from tests.unit.test_bad_inputs import assert_refused, run_cli

ROOT = Path(__file__).resolve().parents[2]
POLYNOMIAL = r"(?P<step>\d+)\s.*\s.*\s.*\s.*Z"
BUDGET_S = 0.05  # per line, for the function the agent's loop calls
DEADLINE_S = 20.0  # for the whole child: today's backtracking matcher takes minutes on one line

TIMED = textwrap.dedent(r"""
    import json, sys, time
    from pathlib import Path
    from ffctl.agent.stepscan import StepScanner, compile_step_regex, parse_line

    pattern = compile_step_regex(sys.argv[1])
    # Each a step and a space, then 4,094 characters with no Z: every split of the tail among the
    # four `.*` is tried from every digit (n^4 for Python's re).
    hostile = ["1 " + " " * 4094, "1 " + "a " * 2047, "1 " + "1 " * 2047, "1" + " \t" * 2047 + "x"]
    assert all(len(line) == 4096 for line in hostile)

    def timed(line):
        t0 = time.perf_counter()
        assert parse_line(pattern, line) is None
        return time.perf_counter() - t0

    # The best of three per line: a scheduler's hiccup is not the matcher's time.
    worst = max(min(timed(line) for _ in range(3)) for line in hostile)
    # The agent's own loop: a log of such lines around two step lines, one poll.
    log = Path(sys.argv[2])
    log.write_text("".join(line + "\n" for line in hostile) + "7 a b c dZ\n" + "".join(line + "\n" for line in hostile)
                   + "9 \t \t yZ\n")
    scanner = StepScanner(pattern, [(log, 0)])
    t0 = time.perf_counter()
    steps = [s.step for s in scanner.poll()]
    print(json.dumps({"worst": worst, "poll": time.perf_counter() - t0, "steps": steps}))
""")


def test_a_polynomial_step_regex_is_matched_within_the_budget_on_a_hostile_line(tmp_path: Path) -> None:
    compile_step_regex(POLYNOMIAL)  # accepted: the matcher bounds it, no guess from its shape refuses it
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", TIMED, POLYNOMIAL, str(tmp_path / "0.log")], cwd=ROOT,
                             capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"matching {POLYNOMIAL!r} against 4,096-character lines ran past {DEADLINE_S:.0f} s "
                    f"(the agent's loop would stall: its node declared lost)")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["worst"] <= BUDGET_S, f"one line took {got['worst'] * 1000:.1f} ms (budget {BUDGET_S * 1000:.0f} ms)"
    assert got["steps"] == [7, 9]  # the step lines among them still count
    assert got["poll"] < 1.0 and time.monotonic() - t0 < DEADLINE_S


def test_normal_lines_still_give_their_step_and_loss(tmp_path: Path) -> None:
    pattern = compile_step_regex(r"step (?P<step>\d+) loss (?P<loss>\S+)")
    found = parse_line(pattern, "[rank0] step 12 loss 3.41 lr 1e-4")
    assert found is not None and (found.step, found.loss) == (12, 3.41)
    assert parse_line(pattern, "step 13 loss nan").loss != parse_line(pattern, "step 13 loss nan").loss  # type: ignore[union-attr]
    assert parse_line(pattern, "step x loss 1") is None
    first = parse_line(compile_step_regex(r"iter (\d+)"), "iter 5")
    assert first is not None and (first.step, first.loss) == (5, None)
    # The shapes the old check refused by guesswork are matched, fast, like any other.
    for regex in (r"step (?P<step>(\d+)+)x", r"(?P<step>\d+|\d+)+!", r".*(?P<step>\d+)x", r"(?P<step>\d+) (\w+\s?)+$"):
        p = compile_step_regex(regex)
        t0 = time.perf_counter()
        for unit in ("1", " ", "1 a", "a"):
            parse_line(p, unit * MAX_LINE)
        assert time.perf_counter() - t0 < 1.0, regex
    assert parse_line(compile_step_regex(r"(?P<step>\d+) (\w+\s?)+$"), "3 ab cd").step == 3  # type: ignore[union-attr]


def test_a_line_is_matched_on_its_head_only(tmp_path: Path) -> None:
    pattern = compile_step_regex(r"step (?P<step>\d+)")
    assert parse_line(pattern, "step 4 " + "x" * 1_000_000) is not None  # its head says the step
    assert parse_line(pattern, "x" * MAX_LINE + "step 5") is None  # past the cap: never looked at
    # A long line written in pieces keeps its head while it waits for its end.
    log = tmp_path / "0.log"
    log.write_bytes(b"")
    scanner = StepScanner(pattern, [(log, 0)])
    with open(log, "ab") as fh:
        fh.write(b"step 6 " + b"y" * (3 * MAX_LINE))
        fh.flush()
        assert scanner.poll() == []
        fh.write(b"z" * MAX_LINE + b" step 99\nstep 7\n")
        fh.flush()
    assert [s.step for s in scanner.poll()] == [6, 7]


def test_a_flood_of_lines_waits_for_the_next_poll(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stepscan, "POLL_BUDGET_S", 0.002)
    log = tmp_path / "0.log"
    log.write_text("".join(f"step {i}\n" for i in range(5_000)))
    scanner = StepScanner(compile_step_regex(r"step (?P<step>\d+)"), [(log, 0)])
    first = scanner.poll()
    assert 0 < len(first) < 5_000  # cut short by the budget, not by the lines
    steps = [s.step for s in first]
    for _ in range(100_000):
        more = scanner.poll()
        if not more:
            break
        steps += [s.step for s in more]
    assert steps == list(range(5_000))  # none lost, in order


@pytest.mark.parametrize("regex,why", [
    (r"(?P<step>\d+) \1", "no backreferences"),
    (r"(?=step)step (?P<step>\d+)", "lookaround"),
    (r"(?P<step>\d+)" + r"(\s.*)" * 40 + "Z", "at most 256"),
])
def test_what_the_bounded_engine_cannot_take_is_refused_in_one_line(regex: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(StepRegexError, match=why):
        compile_step_regex(regex)
    script = tmp_path / "train.py"
    script.write_text("print('step 1')\n")
    code, printed = run_cli(["launch", "--step-regex", regex, str(script)], tmp_path / "runs", tmp_path)
    assert_refused(code, printed, "--step-regex")
    assert why in printed and not (tmp_path / "runs").exists()
