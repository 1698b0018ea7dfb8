"""`ffctl run SCENARIO.toml --junit FILE` as CI uses it: exit 0 when met, 1 when missed."""
from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers.launch import assert_nothing_left, run_ffctl

pytestmark = pytest.mark.slow

SCENARIO = """
[launch]
nnodes = 2
nproc_per_node = 1
steps = 25
spares = 1
inject = ["kill-rank:rank=1,step=10"]

[expect]
status = "completed"
faults = 1
max_lost_steps = 1
max_recovery_s = {limit}
"""


def test_scenario_met_and_missed(tmp_path: Path) -> None:
    met = tmp_path / "met.toml"
    met.write_text(SCENARIO.format(limit=120.0))
    proc = run_ffctl(tmp_path, "run", str(met), "--junit", str(tmp_path / "met.xml"))
    assert proc.returncode == 0, proc.stderr
    assert ET.parse(tmp_path / "met.xml").getroot().get("failures") == "0"
    missed = tmp_path / "missed.toml"
    missed.write_text(SCENARIO.format(limit=0.000001))
    proc = run_ffctl(tmp_path, "run", str(missed), "--junit", str(tmp_path / "missed.xml"))
    assert proc.returncode == 1
    root = ET.parse(tmp_path / "missed.xml").getroot()
    assert root.get("failures") == "1" and "missed" in proc.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[launch]\nnodez = 2\n")
    proc = run_ffctl(tmp_path, "run", str(bad))
    assert proc.returncode == 2 and "nodez" in proc.stderr
    assert_nothing_left(tmp_path)
