"""A drain's dead man's switch (`ffctl.backends.slurm.DRAIN_SWITCH`), run for real against stand-in
`sinfo` and `scontrol`: it resumes the node once the launch it watches is gone, only while the
node's reason still carries the run's mark, records that, and does nothing when the launch
ends it first."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ffctl.backends.slurm import DRAIN_SWITCH

TAG = "ffctl-deadman:run1:f1"


def _tools(tmp: Path, reason: str) -> dict[str, str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\necho '{reason}'\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$*\" >> {tmp / 'scontrol.calls'}\n")
    for tool in ("sinfo", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _switch(tmp: Path, env: dict[str, str], launch_pid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sh", "-c", DRAIN_SWITCH, TAG, str(launch_pid), "n2", "ffctl:run1:", str(tmp / "dm.jsonl")],
                            env=env, start_new_session=True)


def _waiting(switch: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """`switch` once its traps are set and it waits (its first `sleep` runs)."""
    deadline = time.monotonic() + 30
    while not psutil.Process(switch.pid).children() and time.monotonic() < deadline:
        time.sleep(0.01)
    return switch


def _launch() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_switch_resumes_the_node_once_the_launch_is_gone(tmp_path: Path) -> None:
    env = _tools(tmp_path, "ffctl:run1:f1")
    launch = _launch()
    switch = _switch(tmp_path, env, launch.pid)
    try:
        assert switch.poll() is None and not (tmp_path / "scontrol.calls").exists()
        launch.kill()
        launch.wait()
        assert switch.wait(timeout=30) == 0
    finally:
        launch.kill()
        switch.kill()
    assert (tmp_path / "scontrol.calls").read_text() == "update nodename=n2 state=resume\n"
    [line] = [json.loads(x) for x in (tmp_path / "dm.jsonl").read_text().splitlines()]
    assert line["fault_id"] == "f1" and line["by"] == "deadman" and line["trigger"] == "controller-gone"
    assert line["ok"] is True and line["exit"] == 0 and line["t"] > 0


def test_a_node_drained_again_for_another_reason_is_left_alone(tmp_path: Path) -> None:
    env = _tools(tmp_path, "bad-dimm")
    launch = _launch()
    switch = _switch(tmp_path, env, launch.pid)
    launch.kill()
    launch.wait()
    assert switch.wait(timeout=30) == 0
    assert not (tmp_path / "scontrol.calls").exists()


def test_the_launch_ending_it_resumes_nothing_and_sigusr1_resumes_now(tmp_path: Path) -> None:
    env = _tools(tmp_path, "ffctl:run1:f1")
    launch = _launch()
    try:
        switch = _waiting(_switch(tmp_path, env, launch.pid))
        switch.send_signal(signal.SIGTERM)  # the launch resumed the node itself
        assert switch.wait(timeout=30) == 0
        assert not (tmp_path / "scontrol.calls").exists() and not (tmp_path / "dm.jsonl").exists()
        switch = _waiting(_switch(tmp_path, env, launch.pid))
        switch.send_signal(signal.SIGUSR1)  # `ffctl inject revert --all`: now, the launch still up
        assert switch.wait(timeout=30) == 0
        [line] = [json.loads(x) for x in (tmp_path / "dm.jsonl").read_text().splitlines()]
        assert line["trigger"] == "signal" and (tmp_path / "scontrol.calls").read_text().count("state=resume") == 1
    finally:
        launch.kill()
        launch.wait()
