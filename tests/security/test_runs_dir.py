"""A runs directory another user controls: made 0777 (or owned) by someone else before the
launch, it would let them rename the run's directory and plant links where ffctl then writes the
report, the logs and the token, and where `ffctl report` / `ffctl inject` read them. ffctl refuses
such a directory in one line (exit 2, nothing started), reads the job token only from a private
file of the user's (never through a link), and opens every log without following a link."""
from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

from runs import shm
from runs.store import RunStore, RunStoreError, check_owned_dir
from tests.helpers.launch import ffctl_argv

pytestmark = pytest.mark.timeout(120)


def _nobody() -> int:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no user nobody here")


def _launch(tmp_path: Path, runs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ffctl_argv("launch", "--runs-dir", str(runs), "--steps", "5"), capture_output=True,
                          text=True, cwd=tmp_path, timeout=90)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_runs_dir_another_user_owns_is_refused_before_anything_starts(tmp_path: Path) -> None:
    runs = tmp_path / "ffctl-runs"
    runs.mkdir(mode=0o755)
    os.chown(runs, _nobody(), -1)
    proc = _launch(tmp_path, runs)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.splitlines()
    assert str(runs) in line and f"uid {_nobody()}" in line and "not you" in line
    assert list(runs.iterdir()) == []  # no run directory, no log, no token


def test_a_runs_dir_anyone_can_write_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "ffctl-runs"
    runs.mkdir()
    runs.chmod(0o777)  # as `nobody` left it before root's launch
    proc = _launch(tmp_path, runs)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.splitlines()
    assert "writable by others (mode 777)" in line and "chmod go-w" in line
    assert list(runs.iterdir()) == []
    runs.chmod(0o1777)  # sticky, as /tmp: others still create names in it
    with pytest.raises(RunStoreError, match="writable by others"):
        check_owned_dir(runs, "runs dir")


def test_the_runs_dir_ffctl_makes_is_private_even_under_a_loose_umask(tmp_path: Path) -> None:
    old = os.umask(0o000)
    try:
        store = RunStore.create(tmp_path / "runs", "r1", {"spec": {}})
    finally:
        os.umask(old)
    for path in (tmp_path / "runs", store.path, store.path / "logs"):
        assert path.stat().st_mode & 0o022 == 0, (path, oct(path.stat().st_mode))
    check_owned_dir(tmp_path / "runs", "runs dir")  # a second launch takes it


def test_the_token_is_never_read_through_a_link_or_a_file_others_can_read(tmp_path: Path) -> None:
    store = RunStore.create(tmp_path / "runs", "r1", {"spec": {}})
    token = store.token()
    assert len(token) == 64
    elsewhere = tmp_path / "planted"
    elsewhere.write_text("f" * 64)
    store.token_path.unlink()
    store.token_path.symlink_to(elsewhere)
    with pytest.raises(RunStoreError, match="cannot open its token file"):
        store.token()
    store.token_path.unlink()
    store.token_path.write_text(token)
    store.token_path.chmod(0o644)
    with pytest.raises(RunStoreError, match="not a private file of yours"):
        store.token()
    store.token_path.chmod(0o600)
    assert store.token() == token
    store.path.chmod(0o777)  # the run's directory opened to everyone: its token is not trusted
    with pytest.raises(RunStoreError, match="writable by others"):
        store.token()


def test_a_message_naming_a_run_directory_leaves_its_key_out() -> None:
    key = "89abcdef" * 4
    path = f"/dev/shm/ffctl-ci-run-{key}"
    assert shm.redact(f"{path}/ffctl-ci-run-n0.lock is held") == "/dev/shm/ffctl-ci-run-KEY/ffctl-ci-run-n0.lock is held"
    assert key not in str(shm.UnsafeShm(1, f"{path} belongs to uid 7"))
    assert shm.redact("ffctl-run-0123 and a key-less name") == "ffctl-run-0123 and a key-less name"
