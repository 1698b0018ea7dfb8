"""Scenario files: loading, bad keys, expectations against a report, JUnit output."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ffctl.launch.scenario import ScenarioError, evaluate, junit, load

REPORT = {
    "status": "completed", "steps_completed": 60, "lost_gpu_hours_total": 0.002, "goodput": 0.5,
    "faults": [
        {"fault_id": "f1", "kind": "kill-rank", "recovery_s": 0.4, "detection_s": 0.05, "lost_steps": 0,
         "restore_source": "local-memory"},
        {"fault_id": "f2", "kind": "kill-node", "recovery_s": 6.0, "detection_s": 0.1, "lost_steps": 1,
         "restore_source": "peer-memory"},
    ],
}


def test_load_and_spec(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[launch]\nnnodes = 2\nsteps = 9\ninject = ["kill-rank:rank=1,step=3"]\n[expect]\nstatus = "completed"\n')
    sc = load(path)
    spec = sc.spec(tmp_path, "r1")
    assert spec.nnodes == 2 and spec.steps == 9 and spec.injects[0].trigger.step == 3


@pytest.mark.parametrize("text, needle", [
    ("[launch]\nnodes = 2\n", "'nodes'"),
    ("[expect]\nmax_recovery = 1\n", "'max_recovery'"),
    ("[lunch]\n", "lunch"),
    ("[launch\n", "not valid TOML"),
])
def test_bad_scenarios_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "s.toml"
    path.write_text(text)
    with pytest.raises(ScenarioError, match=needle.replace("[", r"\[")):
        load(path)


def test_expectations_pass_and_miss() -> None:
    ok = evaluate({"status": "completed", "faults": 2, "max_lost_steps": 1, "max_detection_s": 1.0,
                   "restore_source": ["local-memory", "peer-memory"], "min_goodput": 0.4}, REPORT)
    assert ok and all(c.passed for c in ok)
    missed = evaluate({"max_recovery_s": 1.0, "restore_source": "peer-memory", "max_lost_gpu_hours_total": 0.001}, REPORT)
    by_name = {c.name: c for c in missed}
    assert by_name["max_recovery_s[f1]"].passed and not by_name["max_recovery_s[f2]"].passed
    assert "6.000" in by_name["max_recovery_s[f2]"].detail
    assert not by_name["restore_source[f1]"].passed and by_name["restore_source[f2]"].passed
    assert not by_name["max_lost_gpu_hours_total"].passed


def test_junit_counts_failures() -> None:
    checks = evaluate({"max_recovery_s": 1.0}, REPORT)
    root = ET.fromstring(junit("chaos", checks, 3.5))
    assert root.get("tests") == "2" and root.get("failures") == "1"
    assert [c.get("name") for c in root.iter("testcase") if c.find("failure") is not None] == ["max_recovery_s[f2]"]
