"""The controller's pieces stay pieces: read from the source's syntax tree, each class of
`ffctl/controller/` makes its fields in its constructor only, no piece's constructor takes the
controller, and the controller neither sets the coordinator's fields after building it nor drops
what a recovery returns; and the job's ledger of reports takes only kinds it knows."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ffctl.controller.state import JobState, Ledger, Report

FOLDER = Path(__file__).resolve().parents[2] / "ffctl" / "controller"
CONSTRUCTORS = ("__init__", "__post_init__")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _self_fields(fn: ast.AST) -> set[str]:
    """The attributes of `self` that `fn` assigns (plain, annotated or augmented)."""
    out: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for e in ast.walk(target):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def _classes() -> list[tuple[str, ast.ClassDef]]:
    return [(f"{p.name}:{n.name}", n) for p in sorted(FOLDER.glob("*.py"))
            for n in ast.walk(_tree(p)) if isinstance(n, ast.ClassDef)]


def test_fields_are_made_in_the_constructor() -> None:
    late: dict[str, list[str]] = {}
    for name, cls in _classes():
        methods = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
        declared = {a.target.id for a in cls.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)}
        for f in methods:
            if f.name in CONSTRUCTORS:
                declared |= _self_fields(f)
        for f in methods:
            extra = _self_fields(f) - declared if f.name not in CONSTRUCTORS else set()
            if extra:
                late[f"{name}.{f.name}"] = sorted(extra)
    assert not late


def test_no_piece_takes_the_controller() -> None:
    takes = [name for name, cls in _classes() for f in cls.body
             if isinstance(f, ast.FunctionDef) and f.name == "__init__"
             and any(a.annotation is not None and "Controller" in ast.unparse(a.annotation) for a in f.args.args)]
    assert not takes


def test_the_controller_leaves_the_coordinator_alone_and_keeps_its_outcome() -> None:
    tree = _tree(FOLDER / "controller.py")
    written = [ast.unparse(t) for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
               if ast.unparse(t).startswith("self.coordinator.")]
    assert not written
    dropped = [ast.unparse(n) for n in ast.walk(tree)
               if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and ast.unparse(n.value.func).endswith(".recover")]
    assert not dropped


def test_the_ledger_files_each_report_under_a_checked_kind() -> None:
    ledger = Ledger()
    ledger.add(Report.JOINED, 1, [0, 1])
    ledger.add("joined", 1, [2])  # a kind's value is the kind
    assert ledger.ranks(Report.JOINED, 1) == {0, 1, 2} and ledger.ranks("joined", 2) == set()
    ledger.ranks(Report.JOINED, 1).add(9)  # a copy: the ledger changes only through `add`
    assert 9 not in ledger.ranks(Report.JOINED, 1)
    assert ledger.ever(2, (Report.STARTED, Report.JOINED)) and not ledger.ever(3, (Report.JOINED,))
    with pytest.raises(ValueError):
        ledger.add("joinde", 1, [0])  # a typo is an error, not a set nobody fills
    job = JobState.for_world(2, 1)
    job.reports.add(Report.DONE, 0, [1])
    assert job.reported(Report.DONE, 0) == {1}
