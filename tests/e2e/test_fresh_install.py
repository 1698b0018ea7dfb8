"""ffctl as a new user gets it: the built wheel in a fresh virtual environment that holds torch and
the wheel's declared dependencies and nothing else (no numpy), then a `restart-disk` and a `peer`
job with a fault, run with that environment's `ffctl` from outside the source tree.

This is what catches an undeclared dependency: the suite itself runs in an environment where the
developer's extra packages may hide one.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.launch import assert_nothing_left, rid, shm_left

# A fresh virtual environment built and the wheel installed, then two jobs run from it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the release scripts/setup installs
PACKAGES = ("ffctl", "recovery", "runs", "fault_injectors", "wire")
PIP_TIMEOUT = 600.0
JOB_TIMEOUT = 300.0
NUMPY_WARNING = "Failed to initialize NumPy"


def _env(venv: Path) -> dict[str, str]:
    """The environment of a user who put the venv first on PATH: nothing points back at the
    source tree or at another environment's packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with torch and the wheel built from this tree (its dependencies from the
    package index or pip's cache)."""
    base = tmp_path_factory.mktemp("fresh")
    env = _env(base / "venv")
    # torch is several GB when it has to be downloaded: use only a wheel pip already has locally.
    wheels = base / "wheels"
    got = _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-index", "-d", str(wheels), TORCH],
               base, env, PIP_TIMEOUT)
    torch_wheels = sorted(wheels.glob("torch-*.whl"))
    if got.returncode != 0 or not torch_wheels:
        pytest.skip(f"no local {TORCH} wheel to install offline: {(got.stderr.strip().splitlines() or ['?'])[-1]}")

    # Build from a copy of the sources, so setuptools' build/ directory in the tree (which it
    # would pack, stale modules included) plays no part.
    src = base / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _ok(_run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)],
             base, env, PIP_TIMEOUT))
    (ffctl_wheel,) = wheels.glob("ffctl-*.whl")

    # No --system-site-packages: nothing of the interpreter running this test is visible.
    _ok(_run([sys.executable, "-m", "venv", str(base / "venv")], base, env, PIP_TIMEOUT))
    python = str(base / "venv" / "bin" / "python")
    _ok(_run([python, "-m", "pip", "install", "-q", str(torch_wheels[0]), str(ffctl_wheel)], base, env, PIP_TIMEOUT))
    for whl in torch_wheels:
        whl.unlink()  # 200 MB that pytest would otherwise keep with its last temporary directories
    return base / "venv"


@pytest.fixture(scope="module")
def workdir(venv: Path) -> Path:
    """Outside the source tree, so `python -m ffctl...` finds only the installed package."""
    path = venv.parent / "work"
    path.mkdir()
    return path


def test_fresh_venv_has_no_numpy_and_runs_the_installed_package(venv: Path, workdir: Path) -> None:
    env = _env(venv)
    python = str(venv / "bin" / "python")
    numpy = _run([python, "-c", "import numpy"], workdir, env, 60)
    assert numpy.returncode != 0 and "No module named 'numpy'" in numpy.stderr
    where = _ok(_run([python, "-c", "import ffctl, recovery, torch; print(ffctl.__file__); print(recovery.__file__)"],
                     workdir, env, 120))
    site = str(venv / "lib")
    assert all(line.startswith(site) for line in where.stdout.split()), where.stdout
    helped = _ok(_run([str(venv / "bin" / "ffctl"), "--help"], workdir, env, 120))
    assert "launch" in helped.stdout
    assert NUMPY_WARNING not in helped.stderr and helped.stderr == "", helped.stderr


# The tiny model's steps take milliseconds, and a kill "at step 8" is sent from outside once every
# rank has committed step 8: on a loaded host the ranks may commit several more meanwhile (seen:
# it landed after step 15). Steps enough that it always lands with room to train again after it.
STEPS = 40


def _launch(venv: Path, workdir: Path, run_id: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    argv = [str(venv / "bin" / "ffctl"), "launch", "--run-id", run_id, "--runs-dir", str(workdir / "runs"),
            "--nnodes", "1", "--nproc-per-node", "2", "--steps", str(STEPS), "--model", "tiny", "--seed", "5", *args]
    proc = _run(argv, workdir, _env(venv), JOB_TIMEOUT)
    _ok(proc)
    shown = _ok(_run([str(venv / "bin" / "ffctl"), "report", run_id, "--json", "--runs-dir", str(workdir / "runs")],
                     workdir, _env(venv), 120))
    report = json.loads(shown.stdout)
    assert report == json.loads((workdir / "runs" / run_id / "report.json").read_text())
    # Neither the controller nor any agent or rank met a missing numpy.
    texts = [proc.stdout, proc.stderr, shown.stderr]
    logs = workdir / "runs" / run_id / "logs"
    texts += [log.read_text(errors="replace") for log in [*logs.rglob("*.log"), *logs.rglob("*.err")]]
    assert len(texts) > 3, "no rank logs were written"
    for text in texts:
        assert "numpy" not in text.lower(), text[-2000:]
    assert_nothing_left(workdir)
    assert not shm_left(run_id)
    return proc, report


def _one_recovered_fault(report: dict[str, Any], source: str, workdir: Path) -> dict[str, Any]:
    # On failure, the run's whole record says why better than the fault's summary.
    record = (workdir / "runs" / report["run_id"] / "events.jsonl").read_text()
    assert report["status"] == "completed" and report["steps_completed"] == STEPS, record
    (fault,) = report["faults"]
    assert fault["kind"] == "kill-rank" and fault["recovered"], (fault, record)
    assert fault["restore_source"] == source, (fault, record)
    return fault


def test_fresh_venv_restart_disk_and_peer_recover_a_kill(venv: Path, workdir: Path) -> None:
    _, disk = _launch(venv, workdir, rid("fresh-disk"), "--recovery", "restart-disk", "--ckpt-every", "5",
                      "--inject", "kill-rank:rank=1,step=8")
    fault = _one_recovered_fault(disk, "disk", workdir)
    # A checkpoint (every 5 steps) read back from disk, not step 0, and none newer than the fault.
    assert fault["restore_step"] % 5 == 0 and 5 <= fault["restore_step"] <= fault["at_step"], fault

    _, peer = _launch(venv, workdir, rid("fresh-peer"), "--recovery", "peer", "--spares", "1",
                      "--inject", "kill-rank:rank=1,step=8")
    _one_recovered_fault(peer, "local-memory", workdir)

    # Both restores are exact: the two jobs, same seed and world size, committed the same losses.
    assert disk["loss_by_step"] == peer["loss_by_step"] and len(disk["loss_by_step"]) == STEPS
