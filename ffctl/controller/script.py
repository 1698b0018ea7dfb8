"""What a user's script is: a rank of the recovery library, or an unchanged (torchrun) script.

Pure: read from the script's source with a regex scan, never by importing it. The controller
must know before the first rank starts, since it waits differently for each; the launch plan,
the doctor and the Slurm batch script ask the same question.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from ffctl.launch_spec import EXEC_MODULE


def uses_recovery_library(script: tuple[str, ...]) -> bool:
    """Whether the ranks run the recovery library (they report `started`, `joined`, steps and
    `done`) or a plain script, whose process being up is all there is to wait for.

    Read from the script's source: a plain torchrun script never imports `recovery`, and the
    controller must know before the first rank starts, since it waits differently for each."""
    if not script:
        return True  # the built-in workload
    if script[0] == "-m" or script[0].startswith("-m"):
        name = script[1] if script[0] == "-m" and len(script) > 1 else script[0][2:]
        if name.startswith("ffctl.workload"):
            return True
        if name == EXEC_MODULE:
            return False  # a program given with --no-python: not Python at all
        # Found without importing it (importing would run the user's package code here).
        parts = name.split(".")
        places = [Path(d or ".", *parts) for d in [str(Path.cwd()), *sys.path]]
        found = [f for p in places for f in (p.with_suffix(".py"), p / "__main__.py") if f.is_file()]
        if not found:
            return True  # cannot tell: wait for the library's messages
        path = found[0]
    else:
        path = Path(script[0])
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return True
    return runs_the_library(text)


def steps_seen(script: tuple[str, ...], step_regex: str | None) -> bool:
    """Whether ffctl will see the job's steps: the built-in workload's and the library's, a plain
    script's `report_step` calls (read from its source), or its output through --step-regex.
    Where not, no `step=` trigger can fire and `t=` counts from the ranks' start."""
    if step_regex or uses_recovery_library(script):
        return True
    if script and not script[0].startswith("-"):
        try:
            return "report_step" in Path(script[0]).read_text(errors="replace")
        except OSError:
            return False
    return False


# What a script may take from `recovery` and stay an unchanged script: one line reporting its steps.
_PLAIN_NAMES = frozenset({"report_step", "steps"})


def runs_the_library(text: str) -> bool:
    """Whether a script's source imports the recovery library for more than `report_step`."""
    for sub, names in re.findall(r"^[ \t]*from[ \t]+recovery((?:\.\w+)*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]+)", text, re.M):
        if sub == ".steps":
            continue
        names = re.sub(r"#[^\n]*", "", names).strip().strip("()")
        imported = {n.split(" as ")[0].strip() for n in names.split(",")} - {""}
        if sub or imported - _PLAIN_NAMES:
            return True
    if re.search(r"^[ \t]*import[ \t]+recovery\b", text, re.M):
        used = set(re.findall(r"\brecovery\.(\w+)", text))
        return not used or bool(used - _PLAIN_NAMES)
    return False
