"""The DDP before/after pair: `examples/ddp/with_ffctl.py` is `plain.py` plus at most 15 added or
changed lines, and docs/guides/ddp.md shows exactly that difference."""
from __future__ import annotations

import difflib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CHANGED = 15


def _diff() -> list[str]:
    plain = (ROOT / "examples/ddp/plain.py").read_text().splitlines()
    ours = (ROOT / "examples/ddp/with_ffctl.py").read_text().splitlines()
    return list(difflib.unified_diff(plain, ours, "plain.py", "with_ffctl.py", lineterm=""))


def test_with_ffctl_differs_from_plain_by_at_most_15_lines() -> None:
    added = [line for line in _diff() if line.startswith("+") and not line.startswith("+++")]
    assert 0 < len(added) <= MAX_CHANGED, "\n".join(added)
    assert any("register_ddp" in line for line in added) and any("job.run" in line for line in added)


def test_docs_show_the_diff() -> None:
    doc = (ROOT / "docs/guides/ddp.md").read_text()
    for line in _diff()[2:]:
        if line.startswith(("+", "-")) and line[1:].strip():
            assert line in doc, f"docs/guides/ddp.md does not show: {line}"
