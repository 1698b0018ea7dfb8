"""Output files are checked before any work: `ffctl report --html`, `ffctl project --html`,
`ffctl run --junit/--markdown` given a FIFO nobody reads, /dev/full, /proc/version, a directory or
a file in a missing directory refuse it with one line naming the option and the path, exit 2,
nothing printed, nothing started (no run directory), nothing written.

The FIFO cases run a real interpreter under a subprocess timeout (written without a reader, it
would hang); the others go through the same entry point in this process.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.cli import ffctl_in_process
from runs.store import RunStore
from tests.helpers.events import StreamBuilder
from tests.helpers.launch import ffctl_argv

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "examples" / "scenarios" / "kill-rank-and-node.toml"
RUN = "out-run"

# Each command with an output option, as argv with {out} for the path. `ffctl bench` and
# `ffctl launch` write no file of their own (their records go to the runs dir).
COMMANDS = {
    "report --html": ["report", RUN, "--html", "{out}"],
    "report list --html": ["report", "--html", "{out}"],
    "project --html": ["project", RUN, "--mtbf", "3h@16", "--html", "{out}"],
    "run --junit": ["run", str(SCENARIO), "--junit", "{out}"],
    "run --markdown": ["run", str(SCENARIO), "--markdown", "{out}"],
    "run --dry-run --junit": ["run", str(SCENARIO), "--dry-run", "--junit", "{out}"],
}


def bad_path(kind: str, tmp_path: Path) -> Path:
    if kind == "fifo":
        fifo = tmp_path / "nobody-reads.pipe"
        os.mkfifo(fifo)
        return fifo
    if kind == "directory":
        return tmp_path
    if kind == "missing-dir":
        return tmp_path / "no" / "such" / "out.txt"
    if kind == "link-to-device":
        link = tmp_path / "full.link"
        link.symlink_to("/dev/full")
        return link
    path = Path(kind)
    if not path.exists():
        pytest.skip(f"{kind} is not on this machine")
    return path


def recorded_run(runs_dir: Path) -> None:
    """A run with a recovered fault, written through the run store as a controller would."""
    b = StreamBuilder(start=1000.0)
    b.run_started(world_size=4, strategy="peer")
    b.steps(1, 10)
    b.fault_injected("f1", at_step=10, dt=0.125)
    b.failure_detected(["f1"], gen=0, dt=0.25)
    b.recovery(["f1"], gen=1, restore_step=10)
    b.steps(11, 20, gen=1)
    b.run_finished("completed", dt=0.25, steps_completed=20)
    store = RunStore.create(runs_dir, RUN, {"spec": {}})
    for ev in b.events:
        store.append(ev.kind, t=ev.t, **ev.data)
    store.close()


@pytest.mark.parametrize("kind", ["fifo", "/dev/full", "/proc/version", "directory", "missing-dir",
                                  "link-to-device"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_bad_output_path_is_refused_before_any_work(command: str, kind: str, tmp_path: Path) -> None:
    if "--html" in COMMANDS[command]:
        pytest.importorskip("matplotlib")
    out = bad_path(kind, tmp_path)
    runs_dir = tmp_path / "runs"
    if command.startswith(("report", "project")):
        recorded_run(runs_dir)
    before = sorted(p.name for p in runs_dir.iterdir()) if runs_dir.exists() else None
    argv = [a.format(out=out) for a in COMMANDS[command]]
    t0 = time.monotonic()
    if kind == "fifo":  # a real interpreter under a timeout: written without a reader, it would hang
        env = {**os.environ, "FFCTL_RUNS_DIR": str(runs_dir)}
        proc = subprocess.run(ffctl_argv(*argv), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    else:
        code, stdout, stderr = run_cli(argv, runs_dir)
    assert time.monotonic() - t0 < 30
    assert code == 2, stdout + stderr
    lines = stderr.splitlines()
    option = next(a for a in argv if a.startswith("--") and argv[argv.index(a) + 1] == str(out))
    assert len(lines) == 1 and f"{option} {str(out)!r}" in lines[0], stderr
    assert "Traceback" not in stderr
    assert stdout == ""  # nothing printed: the report, the plan, a verdict
    # Nothing started: no run directory beside the recorded one (none at all for `ffctl run`).
    after = sorted(p.name for p in runs_dir.iterdir()) if runs_dir.exists() else None
    assert after == before
    if kind == "missing-dir":
        assert not out.parent.exists()


def run_cli(argv: list[str], runs_dir: Path) -> tuple[int, str, str]:
    return ffctl_in_process(argv, {"FFCTL_RUNS_DIR": str(runs_dir)})

def test_a_new_file_an_existing_one_and_a_link_to_one_are_written(tmp_path: Path) -> None:
    """What an output path may be: a new file, an existing one (replaced whole), a link to a
    regular file (the user's own choice: the file it names is written)."""
    pytest.importorskip("matplotlib")
    runs_dir = tmp_path / "runs"
    recorded_run(runs_dir)
    new = tmp_path / "new.html"
    old = tmp_path / "old.html"
    old.write_text("x" * 1_000_000)
    target = tmp_path / "target.html"
    target.write_text("")
    link = tmp_path / "link.html"
    link.symlink_to(target)
    for out in (new, old, link):
        code, stdout, stderr = run_cli(["report", RUN, "--html", str(out)], runs_dir)
        assert code == 0 and stderr == "", stdout + stderr
        assert out.read_text().startswith("<!DOCTYPE html>") or "<html" in out.read_text()[:200]
    assert link.is_symlink() and target.read_text() == link.read_text()
    assert not old.read_text().endswith("x")  # replaced, not overwritten in part


def test_an_unwritable_file_is_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes a read-only file all the same")
    runs_dir = tmp_path / "runs"
    recorded_run(runs_dir)
    out = tmp_path / "read-only.html"
    out.write_text("mine")
    out.chmod(0o444)
    code, stdout, stderr = run_cli(["report", RUN, "--html", str(out)], runs_dir)
    assert code == 2 and stderr.splitlines() == [f"ffctl: error: --html {str(out)!r} is not writable"], stderr
    assert out.read_text() == "mine"
