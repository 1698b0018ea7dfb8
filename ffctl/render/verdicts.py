"""What `ffctl run` writes: the verdicts on the console, a Markdown summary, and JUnit XML.

Each takes scenario outcomes as plain dicts (`Outcome.to_dict()`: name, path, passed, error,
interrupted, seconds, runs, checks with name, passed, measured, bound, detail, run_id, seed).
JUnit: a `<testsuite>` per scenario, a `<testcase>` per expectation whose `<failure>` message
holds the measured value against its bound, the runs' ids and record paths in `<system-out>`; a
launch that could not run is an `<error>` case of its own.
"""
from __future__ import annotations

import re
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from rich.console import Console
from rich.table import Table

LAUNCH_CASE = "launch"  # the test case that holds an infrastructure error


def verdict(outcome: dict[str, Any]) -> str:
    if outcome.get("error"):
        return "error"
    if outcome.get("interrupted"):
        return "interrupted"
    return "passed" if outcome.get("passed") else "failed"


def _runs_text(outcome: dict[str, Any]) -> list[str]:
    lines = []
    for run in outcome.get("runs", []):
        lines.append(f"run {run['run_id']} (seed {run['seed']}): {run['status']}, record {run['record']}")
        twin = run.get("twin")
        if twin:
            lines.append(f"  fault-free twin {twin['run_id']}: {twin['status']}, record {twin['record']}")
    return lines


def render_outcome(outcome: dict[str, Any], console: Console) -> None:
    """One scenario's verdicts: a row per expectation, measured against its bound."""
    word = verdict(outcome)
    color = {"passed": "green", "failed": "red"}.get(word, "yellow")
    table = Table(title=f"{outcome['name']}: [{color}]{word}[/{color}]", title_justify="left")
    for col in ("expectation", "measured", "bound", "verdict"):
        table.add_column(col, overflow="fold")
    for c in outcome.get("checks", []):
        table.add_row(c["name"], c["measured"], c["bound"], "[green]met[/green]" if c["passed"] else "[red]missed[/red]")
    console.print(table)
    if outcome.get("error"):
        console.print(f"{outcome['name']}: infrastructure error: {outcome['error']}", markup=False, highlight=False)
    for c in outcome.get("checks", []):  # what was missed, in full, on a line of its own
        if not c["passed"]:
            console.print(f"{outcome['name']}: {c['name']} missed: {c['detail']}", markup=False, highlight=False,
                          soft_wrap=True)


def render_summary(outcomes: list[dict[str, Any]], console: Console) -> None:
    counts = {w: sum(verdict(o) == w for o in outcomes) for w in ("passed", "failed", "error", "interrupted")}
    text = ", ".join(f"{n} {w}" for w, n in counts.items() if n)
    console.print(f"{len(outcomes)} scenario(s): {text}", markup=False, highlight=False)


def _md(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def markdown(outcomes: list[dict[str, Any]]) -> str:
    """A GitHub-flavoured summary: a table of scenarios, then each one's expectations."""
    mark = {"passed": "✅ passed", "failed": "❌ failed", "error": "⚠️ error", "interrupted": "⚠️ interrupted"}
    lines = ["## ffctl chaos checks", "", "| scenario | verdict | runs | seconds |", "| --- | --- | ---: | ---: |"]
    for o in outcomes:
        lines.append(f"| {_md(o['name'])} | {mark[verdict(o)]} | {len(o.get('runs', []))} | {o.get('seconds', 0.0):.1f} |")
    for o in outcomes:
        lines += ["", f"### {_md(o['name'])}: {mark[verdict(o)]}", ""]
        if o.get("error"):
            lines += [f"Infrastructure error: {_md(o['error'])}", ""]
        if o.get("checks"):
            lines += ["| expectation | measured | bound | verdict | detail |", "| --- | --- | --- | --- | --- |"]
            for c in o["checks"]:
                lines.append(f"| `{c['name']}` | {_md(c['measured'])} | {_md(c['bound'])} | "
                             f"{'met' if c['passed'] else '**missed**'} | {_md(c['detail'])} |")
            lines.append("")
        lines += [f"- {_md(line.strip())}" for line in _runs_text(o)]
    return "\n".join(lines).rstrip() + "\n"


# What XML 1.0 allows no document to hold, not even escaped: C0 controls but tab, newline and
# carriage return, lone surrogates, U+FFFE and U+FFFF. A scenario's name or a run's message may
# carry them (TOML strings take \u001b and \u0000).
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_legal(text: str) -> str:
    r"""`text` with each character XML 1.0 forbids written out as `\xNN` (or `\uNNNN`)."""
    return _NOT_XML.sub(lambda m: ascii(m.group())[1:-1], text)


def junit(outcomes: list[dict[str, Any]]) -> str:
    """JUnit XML as CI systems read it (Jenkins, GitLab, GitHub test-report actions); always
    well-formed, whatever the names and messages it quotes hold."""
    return _xml_legal(_junit(outcomes))


def _junit(outcomes: list[dict[str, Any]]) -> str:
    suites = []
    total = {"tests": 0, "failures": 0, "errors": 0}
    for o in outcomes:
        name = o["name"]
        cases = []
        for c in o.get("checks", []):
            body = ""
            if not c["passed"]:
                message = f"{c['name']}: measured {c['measured']}, bound {c['bound']}: {c['detail']}"
                body += f"<failure message={quoteattr(message)} type=\"expectation\">{escape(message)}</failure>"
            if c.get("run_id"):
                body += f"<system-out>{escape('measured on run ' + str(c['run_id']))}</system-out>"
            # Verdicts take no time of their own: the runs' time is the suite's.
            cases.append(f'    <testcase classname={quoteattr(name)} name={quoteattr(c["name"])} '
                         f'time="0.000">{body}</testcase>')
        errors = 0
        if o.get("error") or o.get("interrupted"):
            errors = 1
            why = o.get("error") or "interrupted"
            cases.append(f'    <testcase classname={quoteattr(name)} name="{LAUNCH_CASE}" time="0.000">'
                         f'<error message={quoteattr(why)} type="infrastructure">{escape(why)}</error></testcase>')
        failures = sum(not c["passed"] for c in o.get("checks", []))
        tests = len(cases)
        total["tests"] += tests
        total["failures"] += failures
        total["errors"] += errors
        out = "\n".join([f"scenario {o.get('path', '')}"] + _runs_text(o))
        suites.append(f'  <testsuite name={quoteattr(name)} tests="{tests}" failures="{failures}" errors="{errors}" '
                      f'time="{o.get("seconds", 0.0):.3f}">\n' + "\n".join(cases)
                      + f"\n    <system-out>{escape(out)}</system-out>\n  </testsuite>")
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuites name="ffctl run" tests="{total["tests"]}" '
            f'failures="{total["failures"]}" errors="{total["errors"]}">\n' + "\n".join(suites) + "\n</testsuites>\n")
