"""Sizes a newcomer can read in one sitting: the controller's module under 350 lines, and no class
over 300 lines. Counted from the source's syntax tree (a class runs from its `class` line to its
last statement), so a long docstring or comment counts as much as code does."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = ROOT / "ffctl" / "controller" / "controller.py"
MAX_CONTROLLER_LINES = 349
MAX_CLASS_LINES = 300
# Where no class may be longer than MAX_CLASS_LINES: all of ffctl (the controller's pieces, the
# agent's, the node backends, the SSH transport, the command line, the simulation, ...).
CHECKED = ROOT / "ffctl"


def _classes(folder: Path) -> dict[str, int]:
    """`path:Class` -> its length in lines, for every class (nested ones too) under `folder`."""
    out: dict[str, int] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                out[f"{path.relative_to(folder)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_the_controller_module_reads_in_one_sitting() -> None:
    lines = len(CONTROLLER.read_text().splitlines())
    assert lines <= MAX_CONTROLLER_LINES, f"{CONTROLLER.relative_to(ROOT)}: {lines} lines"


def test_no_class_in_ffctl_is_over_300_lines() -> None:
    sizes = _classes(CHECKED)
    assert "agent/agent.py:Agent" in sizes and "controller/controller.py:Controller" in sizes  # it looks everywhere
    long = {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}
    assert not long, long


def test_the_class_counter_sees_every_class(tmp_path: Path) -> None:
    # The check above is only as good as its counter: nested classes count, and a class's last
    # line is its last statement's.
    (tmp_path / "m.py").write_text("class A:\n    x = 1\n\n    class B:\n        y = 2\n        z = 3\n")
    sizes = {name.split(":")[1]: n for name, n in _classes(tmp_path).items()}
    assert sizes == {"A": 6, "B": 3}
