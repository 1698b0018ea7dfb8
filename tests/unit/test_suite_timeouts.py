"""The suite's own limits: a test that hangs fails within 120 s unless it says why it needs longer
(a `timeout` mark of more than 120 s carries a comment on its line or the line above)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"pytest\.mark\.timeout\((\d+)\)")


def test_the_default_timeout_is_at_most_120_s() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert 0 < int(config["timeout"]) <= 120


def test_every_longer_timeout_says_why() -> None:
    silent = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            for seconds in MARK.findall(line):
                said = "#" in line or (i > 0 and lines[i - 1].lstrip().startswith("#"))
                if int(seconds) > 120 and not said:
                    silent.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert not silent, f"timeouts over 120 s without a reason: {silent}"
