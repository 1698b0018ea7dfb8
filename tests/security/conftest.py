"""The attacks run the ffctl of this source tree: its subprocesses (`python -m ffctl`, agents and
ranks, started from a test's own directory) import it first."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def this_source_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + (os.pathsep + path if path else ""))
