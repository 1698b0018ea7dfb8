"""torchrun's own launcher cases (the command lines of pytorch's launcher tests), with `ffctl
launch` in torchrun's place: every worker of the layout torchrun gives runs, sees the parent's
environment and touches a file named after its global rank; the command lines torchrun refuses
are refused (one line, exit 2, nothing started); a failing worker fails the launch."""
from __future__ import annotations

import os
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.helpers.launch import TIMEOUT, assert_nothing_left, ffctl_argv, launcher_env, rid

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOUCH = textwrap.dedent("""
    import argparse, os, sys
    parser = argparse.ArgumentParser()
    parser.add_argument("--touch-file-dir")
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args()
    if args.fail:
        raise RuntimeError("raising exception to cause the launcher to fail")
    assert os.environ["TEST_SENTINEL_PARENT"] == "FOOBAR"  # the parent's environment reached us
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        assert os.environ.get(name), name
    open(os.path.join(args.touch_file_dir, os.environ["RANK"]), "x").close()
""")

TOUCH_SH = "#!/bin/sh\ntouch \"$1/$RANK\"\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _case(name: str) -> tuple[list[str], dict[str, str], int]:
    """torchrun's options for the case, its PET_* variables, and the ranks torchrun runs."""
    common = ["--monitor-interval=1", "--start-method=spawn"]
    c10d = ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}", f"--rdzv-id={rid('x')}"]
    return {
        "user_script_python": (["--nnodes=1", "--nproc-per-node=4", f"--rdzv-id={rid('x')}", *common, "PY"], {}, 4),
        "caffe2_bc": (["--nnodes=1", "--nproc-per-node=4", *common, "--master-addr=localhost",
                       f"--master-port={_free_port()}", "--node-rank=0", "PY"], {}, 4),
        "user_script_bash": (["--nnodes=1", "--nproc-per-node=4", *common, "--no-python", "SH"], {}, 4),
        "default_nproc": (["--nnodes=1", *common, "--no-python", "SH"], {}, 1),
        "env_vars": (["SH"], {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "4", "PET_RDZV_ID": rid("x"),
                              "PET_MONITOR_INTERVAL": "1", "PET_START_METHOD": "spawn", "PET_NO_PYTHON": "1",
                              "PET_MODULE": "0"}, 4),
        "nproc_auto": (["--nnodes=1", "--nproc-per-node=auto", *common, "--no-python", "SH"], {},
                       os.cpu_count() or 1),
        "nproc_number": (["--nnodes=1", "--nproc-per-node=4", *common, "--no-python", "SH"], {}, 4),
        # One host, MIN:MAX: one node once MIN may start, 4 ranks (not 2 nodes and 8).
        "elastic": (["--nnodes=1:2", "--nproc-per-node=4", *c10d,
                     "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", *common, "PY"], {}, 4),
        "standalone": (["--nnodes=1", "--nproc-per-node=4", "--standalone", *common, "PY"], {}, 4),
        "run_path": (["--run-path", "--nnodes=1", "--nproc-per-node=4", *common, "PY"], {}, 4),
    }[name]


def _run(work: Path, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = ffctl_argv("launch", "--run-id", rid("case"), "--runs-dir", str(work / "runs"), *argv)
    return subprocess.run(full, cwd=work, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**launcher_env(), "TEST_SENTINEL_PARENT": "FOOBAR", **env})


def _script_args(argv: list[str], work: Path, touched: Path) -> list[str]:
    out: list[str] = []
    for a in argv:
        if a == "PY":
            out += [str(work / "test_script.py"), f"--touch-file-dir={touched}"]
        elif a == "SH":
            out += [str(work / "test_script.sh"), str(touched)]
        else:
            out.append(a)
    return out


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "test_script.py").write_text(TOUCH)
    sh = tmp_path / "test_script.sh"
    sh.write_text(TOUCH_SH)
    sh.chmod(0o755)
    (tmp_path / "touched").mkdir()
    return tmp_path


@pytest.mark.parametrize("case", ["user_script_python", "caffe2_bc", "user_script_bash", "default_nproc",
                                  "env_vars", "nproc_auto", "nproc_number", "elastic", "standalone", "run_path"])
def test_torchruns_launcher_case_runs_every_rank_it_runs(work: Path, case: str) -> None:
    argv, env, world = _case(case)
    touched = work / "touched"
    proc = _run(work, _script_args(argv, work, touched), env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(touched)) == sorted(str(r) for r in range(world))
    assert_nothing_left(work)


@pytest.mark.parametrize("argv, env, bad", [
    (["--nnodes=1", "--nproc-per-node=4", "--no-python", "--module", "SH"], {}, "--no-python"),
    (["SH"], {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "4", "PET_NO_PYTHON": "1", "PET_MODULE": "1"}, "--no-python"),
    (["--nnodes=1", "--nproc-per-node=unknown", "--no-python", "SH"], {}, "unknown"),
])
def test_command_lines_torchrun_refuses_are_refused_before_anything_starts(
        work: Path, argv: list[str], env: dict[str, str], bad: str) -> None:
    proc = _run(work, _script_args(argv, work, work / "touched"), env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and bad in lines[0], proc.stderr
    assert os.listdir(work / "touched") == [] and not (work / "runs").exists()


def test_a_worker_that_raises_fails_the_launch(work: Path) -> None:
    argv = ["--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{_free_port()}",
            "--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", "--monitor-interval=1",
            "--max-restarts=0", "--start-method=spawn", str(work / "test_script.py"), "--fail"]
    proc = _run(work, argv, {})
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "RuntimeError: raising exception to cause the launcher to fail" in proc.stderr
    assert_nothing_left(work)
