"""The code passes `mypy` with the configuration in pyproject.toml (`[tool.mypy]`: the four
packages, bodies of unannotated functions included, no `type: ignore` that is not needed)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install '.[test]')")
def test_mypy_finds_nothing() -> None:
    # No arguments: what to check and how comes from pyproject.toml alone, as for anyone who runs
    # `mypy` in the repository. Its cache (.mypy_cache, which ignores itself in git) makes a second
    # run take seconds; a first one takes about twenty.
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
