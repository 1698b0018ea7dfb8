"""`ffctl run` as CI runs it: the example scenarios pass as a folder; a bound no run can meet is
missed (exit 1) with the measured value in the JUnit file, the worst of repeated runs reported;
a run whose losses differ from its fault-free twin's fails naming the first differing step."""
from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.helpers.launch import assert_nothing_left, run_ffctl, shm_left

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "scenarios"


# Their bounds (detection within 2 s, ...) are what CI machines are asked to meet, alone.
@pytest.mark.exclusive
@pytest.mark.timeout(1200)  # every example scenario in turn, two of them with a fault-free twin
def test_the_example_scenarios_pass_as_ci_runs_them(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        args = [str(EXAMPLES)]  # the folder, as the workflow in docs/guides/ci.md runs it
    else:  # the netns sandbox needs root; every other scenario runs as anyone
        args = [str(p) for p in sorted(EXAMPLES.glob("*.toml")) if "sandbox" not in p.read_text()]
    junit, summary = tmp_path / "chaos.xml", tmp_path / "summary.md"
    proc = run_ffctl(tmp_path, "run", *args, "--junit", str(junit), "--markdown", str(summary), timeout=900)
    # Which scenario failed, and on what: the summary names each (the console's tail may not).
    why = (summary.read_text() if summary.exists() else "") + proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, why
    root = ET.parse(junit).getroot()
    suites = root.findall("testsuite")
    assert len(suites) == len(list(EXAMPLES.glob("*.toml"))) - (0 if os.geteuid() == 0 else 1)
    assert root.get("failures") == "0" and root.get("errors") == "0"
    assert all(int(s.get("tests") or 0) >= 3 for s in suites)
    text = summary.read_text()
    assert "❌" not in text and text.count("✅ passed") == 2 * len(suites)
    # The chaos scenario ran its fault-free twin and matched it bit for bit.
    assert re.search(r"`matches_fault_free` \| identical over \d+ steps", text), text
    assert_nothing_left(tmp_path)
    runs = [p.name for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    twins = [p for p in EXAMPLES.glob("*.toml") if re.search(r"(?m)^matches_fault_free = true", p.read_text())]
    assert len(twins) >= 2  # the seeded chaos scenario and the FSDP2 one
    assert len(runs) == len(suites) + len(twins)  # and each such scenario's fault-free twin
    assert not [shm for r in runs for shm in shm_left(r)]


def test_an_unmeetable_bound_is_missed_in_every_repeat_and_junit_says_by_how_much(tmp_path: Path) -> None:
    scenario = tmp_path / "gpu-error-strict.toml"
    text = (EXAMPLES / "gpu-error.toml").read_text()
    scenario.write_text(re.sub(r"(?m)^max_recovery_s = .*$", "max_recovery_s = 0.001", text))
    junit, summary = tmp_path / "strict.xml", tmp_path / "strict.md"
    proc = run_ffctl(tmp_path, "run", str(scenario), "--repeat", "2", "--run-id", "strict",
                     "--junit", str(junit), "--markdown", str(summary), timeout=400)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    (suite,) = ET.parse(junit).getroot().findall("testsuite")
    assert suite.get("failures") == "1" and suite.get("errors") == "0"
    failed = {c.get("name"): c.find("failure") for c in suite.iter("testcase") if c.find("failure") is not None}
    assert list(failed) == ["max_recovery_s"]
    message = failed["max_recovery_s"].get("message") or ""  # type: ignore[union-attr]
    measured = float(re.search(r"measured (\d+\.\d+) s", message).group(1))  # type: ignore[union-attr]
    assert measured > 0.001 and "bound <= 0.001 s" in message and "gpu-error" in message
    assert "worst of 2 runs (2 missed)" in message
    # Both runs' ids and records are in the suite's output; the worst one is named in the case.
    out = suite.find("system-out").text or ""  # type: ignore[union-attr]
    assert "run strict-gpu-error-strict-0 (seed 0)" in out and "run strict-gpu-error-strict-1 (seed 1)" in out
    assert str(tmp_path / "runs" / "strict-gpu-error-strict-0") in out
    worst = re.search(r"run (strict-gpu-error-strict-\d)", message).group(1)  # type: ignore[union-attr]
    figures = [f["recovery_s"] for i in (0, 1) for f in
               json.loads((tmp_path / "runs" / f"strict-gpu-error-strict-{i}" / "report.json").read_text())["faults"]]
    assert measured == pytest.approx(max(figures), abs=0.0005)  # the worst of the two runs
    assert worst == f"strict-gpu-error-strict-{figures.index(max(figures))}"
    md = summary.read_text()
    assert "❌ failed" in md and "| `max_recovery_s` |" in md and "**missed**" in md
    assert "max_recovery_s missed" in proc.stdout
    assert_nothing_left(tmp_path)


# A plain script whose data, from step 5 on, comes from the operating system's randomness: the
# run and its fault-free twin agree on steps 1-4 and part at step 5, whatever the fault did.
NONDETERMINISTIC = '''
import os
import struct
import time

import torch

torch.manual_seed(0)
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([w], lr=0.1)
for step in range(1, 11):
    g = torch.Generator().manual_seed(step if step < 5 else struct.unpack("<Q", os.urandom(8))[0])
    x = torch.randn(16, 4, generator=g)
    loss = (x @ w - x.sum(dim=1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)
    print(f"step {step} loss {loss.item()!r}", flush=True)
'''


def test_matches_fault_free_fails_at_the_first_differing_step_when_determinism_is_broken(tmp_path: Path) -> None:
    (tmp_path / "noisy.py").write_text(NONDETERMINISTIC)
    scenario = tmp_path / "noisy.toml"
    scenario.write_text(
        '[launch]\nscript = "noisy.py"\nmax_restarts = 1\n'
        "step_regex = '^step (?P<step>\\d+) loss (?P<loss>\\S+)$'\n"
        '[faults]\ninject = ["kill-rank:rank=0,step=2"]\n'
        "[expect]\ncompletes = true\nmatches_fault_free = true\n")
    junit = tmp_path / "noisy.xml"
    proc = run_ffctl(tmp_path, "run", str(scenario), "--run-id", "noisy", "--junit", str(junit), timeout=300)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "matches_fault_free missed: first differing step 5:" in proc.stdout, proc.stdout[-3000:]
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["completes"].find("failure") is None
    message = cases["matches_fault_free"].find("failure").get("message")  # type: ignore[union-attr]
    assert "measured differs at step 5" in (message or "") and "fault-free twin (noisy-twin)" in (message or "")
    assert (tmp_path / "runs" / "noisy-twin" / "report.json").exists()
    assert_nothing_left(tmp_path)
