"""The timeouts that decide detection, read from a launch, and the orders among them that defeat
recovery said in one line each (ffctl.launch.timeouts), at launch and in its dry run."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ffctl.cli.app import app
from tests.unit.test_bad_inputs import run_cli
from ffctl.launch.timeouts import GLOO_DEFAULT_S, findings, read_timeouts, script_pg_timeout


@pytest.mark.parametrize("source, seconds", [
    ("dist.init_process_group('gloo', timeout=timedelta(seconds=90))", 90.0),
    ("dist.init_process_group(backend='nccl',\n    timeout=datetime.timedelta(minutes=100))", 6000.0),
    ("init_process_group(timeout=timedelta(hours=1, minutes=30), device_id=torch.device('cuda', 0))", 5400.0),
    ("init_process_group('gloo')", None),
    ("init_process_group('gloo', timeout=TIMEOUT)", None),
])
def test_a_scripts_process_group_timeout_is_read_from_its_source(source: str, seconds: float | None) -> None:
    assert script_pg_timeout(source) == seconds


def _lines(source: str | None = None, *, library: bool = False, hang: float = 5.0, beat: float = 1.0,
           env: dict[str, str] | None = None, steps_known: bool = False) -> list[str]:
    found = read_timeouts(heartbeat_s=beat, hang_s=hang, script_source=source, library=library, env=env or {})
    return findings(found, steps_known=steps_known)


def test_a_large_process_group_timeout_in_a_script_ffctl_cannot_watch_is_said_with_the_fix() -> None:
    [line] = _lines("init_process_group('gloo', timeout=timedelta(minutes=100))")
    assert "6000 s" in line and "report_step" in line and "init_process_group(timeout=...)" in line
    [default] = _lines("init_process_group('gloo')")
    assert f"{GLOO_DEFAULT_S:g} s (torch's default for gloo)" in default
    # With the script's steps known, ffctl's hang detection covers it.
    assert _lines("init_process_group('gloo', timeout=timedelta(minutes=100))", steps_known=True) == []
    assert _lines(None, library=True) == []  # the built-in GPT and library scripts: ffctl aborts itself


def test_inversions_name_the_setting_to_change() -> None:
    [line] = _lines("init_process_group('gloo', timeout=timedelta(seconds=3))", steps_known=True)
    assert "3 s" in line and "not above the hang timeout 5 s" in line and "--hang-timeout" in line
    [nccl] = _lines(None, library=True, env={"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "4"})
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=4" in nccl and "raise it" in nccl
    assert _lines(None, library=True, env={"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "garbage"}) == []
    slow = _lines(None, library=True, hang=120.0, beat=90.0)
    assert len(slow) == 2 and all("more than a minute" in line for line in slow)


def test_launch_says_them_in_its_dry_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as dist\nfrom datetime import timedelta\n"
                      "dist.init_process_group('gloo', timeout=timedelta(minutes=100))\n")
    res = CliRunner().invoke(app, ["launch", "--dry-run", "--runs-dir", str(tmp_path / "runs"), str(script)])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())  # the plan's lines may wrap on a narrow terminal
    assert "timeouts: a peer lost inside a collective is noticed only when the process-group timeout " \
           "expires, 6000 s (the script's init_process_group(timeout=...))" in out


def test_doctor_checks_a_scripts_timeouts(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch.distributed as dist\nfrom datetime import timedelta\n"
                      "dist.init_process_group('gloo', timeout=timedelta(seconds=2))\n")
    res = CliRunner().invoke(app, ["doctor", "--script", str(script), "--timeout", "60"])
    out = " ".join(res.output.split())
    assert "timeouts: process-group timeout 2 s (the script's init_process_group(timeout=...)) is not above " \
           "the hang timeout 5 s" in out, res.output
    code, printed = run_cli(["doctor", "--script", str(tmp_path / "nope.py")], tmp_path / "runs", tmp_path)
    assert code == 2 and "nope.py" in printed and len(printed.strip().splitlines()) == 1, printed
