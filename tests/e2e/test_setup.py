"""scripts/setup on a machine where apt is busy: only .venv and ffctl's install into it are
required, so a held apt lock (unattended-upgrades on a fresh cloud machine) costs the optional
system tools, named with the tests they serve, and not the setup.

The runs are real: the tree's tracked files are copied to a temporary folder and the copy's
scripts/setup runs as root inside a mount namespace of its own (`unshare --mount`, gone with its
last process), where chromium is missing (a non-executable file is mounted over it), so that setup
wants an apt package, while this test holds apt's locks as apt takes them (fcntl). apt-get is
reached through a wrapper first on the PATH that runs the real one and notes each call and how
long it took.

The copy's .venv exists beforehand, as on a second run or for a user who put their own torch into
it first: a fresh venv whose torch is that of the environment running the tests, through a .pth
line (installing torch's wheel would cost a minute). That environment is mounted read-only in the
namespace: setup installs ffctl into the copy's .venv and nowhere else.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
# The locks apt-get takes: `install` dpkg's frontend lock (waiting DPkg::Lock::Timeout for it),
# `update` the package lists' (held while apt-daily refreshes them).
APT_LOCKS = (Path("/var/lib/dpkg/lock-frontend"), Path("/var/lib/apt/lists/lock"))
SETUP_TIMEOUT = 240.0
READY = re.compile(r"^setup: \.venv ready: torch \S+ \(kept\), ffctl \S+ \(installed\)$", re.M)


def _copy_tree(dest: Path) -> Path:
    """The tracked files as they are in the working tree (deleted ones left out)."""
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        src, dst = ROOT / name, dest / name
        if not src.is_symlink() and not src.is_file():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)
    return dest


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files to copy")
    return _copy_tree(tmp_path_factory.mktemp("tree"))


def _site_dirs() -> list[str]:
    """Where the environment running the tests keeps its packages, torch among them."""
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths["purelib"]), os.path.realpath(paths["platlib"])})


@pytest.fixture(scope="module")
def venv_tree(tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tree with a .venv that runs and imports torch (see the module's docstring)."""
    _needs_root_apt_unshare()  # before the venv is made, for nothing else uses it
    copy = _copy_tree(tmp_path_factory.mktemp("venv-tree"))
    subprocess.run([sys.executable, "-m", "venv", str(copy / ".venv")], check=True, capture_output=True, timeout=120)
    python = str(copy / ".venv" / "bin" / "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "torch-of-the-test-environment.pth").write_text("".join(f"{d}\n" for d in _site_dirs()))
    subprocess.run([python, "-c", "import torch"], check=True, capture_output=True, timeout=120)
    return copy


def _needs_root_apt_unshare() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (mount namespace, apt's locks)")
    for tool in ("apt-get", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} here")
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount refused: {probe.stderr.strip()}")
    for lock in APT_LOCKS:
        if not lock.exists():
            pytest.skip(f"no {lock} (apt has never run here)")


@pytest.fixture
def apt_locks_held() -> Iterator[None]:
    """apt's locks held by this process, as another apt or unattended-upgrades holds them."""
    _needs_root_apt_unshare()
    fds = []
    try:
        for lock in APT_LOCKS:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
            fds.append(fd)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    pytest.skip(f"{lock} is held by another process: apt is busy here for real")
                raise
        yield
    finally:
        for fd in fds:
            os.close(fd)  # (closing it releases the lock)


def _apt_tracer(folder: Path) -> tuple[Path, Path]:
    """A folder with an `apt-get` that runs the real one and notes: start, end, exit status, args."""
    real = shutil.which("apt-get")
    assert real is not None
    folder.mkdir()
    log = folder / "calls.log"
    tracer = folder / "apt-get"
    tracer.write_text(
        "#!/bin/sh\n"
        "start=$(date +%s.%N)\n"
        f"{shlex.quote(real)} \"$@\"\n"
        "rc=$?\n"
        f"echo \"$start $(date +%s.%N) $rc $*\" >> {shlex.quote(str(log))}\n"
        "exit $rc\n")
    tracer.chmod(0o755)
    return folder, log


def _calls(log: Path) -> list[tuple[float, float, int, str]]:
    if not log.exists():
        return []
    calls = []
    for line in log.read_text().splitlines():
        start, end, rc, args = line.split(" ", 3)
        calls.append((float(start), float(end), int(rc), args))
    return calls


def _env(path_first: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHON", "FFCTL_APT_LOCK_TIMEOUT",
                        "FFCTL_TORCH_INDEX_URL")}
    if path_first is not None:
        env["PATH"] = f"{path_first}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = SETUP_TIMEOUT
         ) -> tuple[subprocess.CompletedProcess[str], float]:
    """argv in a session of its own, all of which is killed if it outlasts the timeout."""
    began = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv} ran past {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), time.monotonic() - began


def _setup_without_chromium(copy: Path, env: dict[str, str], *args: str
                            ) -> tuple[subprocess.CompletedProcess[str], float]:
    """The copy's scripts/setup in a mount namespace where chromium is a file that is not
    executable and the test environment's packages are read-only."""
    blank = copy.parent / "not-executable"
    blank.write_text("")
    blank.chmod(0o644)
    script = ["set -e"]
    for found in {shutil.which("chromium"), "/usr/sbin/chromium"}:
        if found and os.path.exists(found):
            script.append(f"mount --bind {shlex.quote(str(blank))} {shlex.quote(found)}")
    for site in _site_dirs():
        script.append(f"mount --bind {shlex.quote(site)} {shlex.quote(site)}")
        script.append(f"mount -o remount,bind,ro {shlex.quote(site)}")
    script.append(shlex.join(["exec", "scripts/setup", *args]))
    return _run(["unshare", "--mount", "sh", "-c", "\n".join(script)], copy, env)


def _said(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


def _installed_in(copy: Path) -> None:
    """ffctl imports from the copy's .venv, not from the environment lending it torch."""
    where = subprocess.run([str(copy / ".venv" / "bin" / "python"), "-c", "import ffctl; print(ffctl.__file__)"],
                           cwd=copy.parent, capture_output=True, text=True, timeout=60, env=_env())
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(copy / ".venv")), where.stdout


# A venv made, then setup with pip building and installing ffctl: 50-80 s on a busy two-core host.
@pytest.mark.timeout(300)
def test_setup_completes_while_apt_is_locked_and_names_what_it_skipped(
        venv_tree: Path, apt_locks_held: None, tmp_path: Path) -> None:
    tracer, log = _apt_tracer(tmp_path / "trace")
    proc, took = _setup_without_chromium(venv_tree, _env(tracer, FFCTL_APT_LOCK_TIMEOUT="2"))
    said = _said(proc)
    assert proc.returncode == 0, said

    # apt was asked for chromium, waited its 2 s for the lock, and gave up: not the default 120 s.
    calls = _calls(log)
    installs = [c for c in calls if " install " in f" {c[3]} "]
    assert installs and any("chromium" in c[3] and c[2] != 0 for c in installs), (calls, said)
    assert any(" update " in f" {c[3]} " for c in calls), (calls, said)
    apt_took = max(c[1] for c in calls) - min(c[0] for c in calls)
    assert apt_took < 30, (apt_took, calls)
    assert "waits up to 2s for a lock" in proc.stderr, said

    # Said what it skipped and what for, as it happened and in the summary, then what it did.
    assert re.search(r"^setup: skipped chromium \(the HTML report's screenshot test\): E: .*lock", proc.stderr,
                     re.M), said
    summary = [line for line in proc.stderr.splitlines() if line.startswith("setup: skipped chromium")]
    assert len(summary) == 2 and "run scripts/setup again" in summary[-1], said
    assert READY.search(proc.stderr), said
    assert re.search(r"^setup: next: \.venv/bin/ffctl launch ", proc.stderr, re.M), said
    _installed_in(venv_tree)
    print(f"setup took {took:.1f} s, apt {apt_took:.1f} s")


# Setup with pip building and installing ffctl: about 40 s on a busy two-core host.
@pytest.mark.timeout(300)
def test_no_system_runs_no_apt_get_even_with_its_lock_held(venv_tree: Path, apt_locks_held: None,
                                                           tmp_path: Path) -> None:
    # No FFCTL_APT_LOCK_TIMEOUT: an apt-get would wait the default 120 s for the lock.
    tracer, log = _apt_tracer(tmp_path / "trace")
    proc, took = _setup_without_chromium(venv_tree, _env(tracer), "--no-system")
    said = _said(proc)
    assert proc.returncode == 0, said
    assert _calls(log) == [] and not log.exists(), log.read_text() if log.exists() else ""
    assert took < 120, (took, said)  # an apt-get would wait that long for the lock by itself
    assert re.search(r"^setup: --no-system: no apt-get$", proc.stderr, re.M), said
    assert re.search(r"^setup: skipped chromium \(the HTML report's screenshot test\).*without --no-system",
                     proc.stderr, re.M), said
    assert READY.search(proc.stderr), said
    _installed_in(venv_tree)
    print(f"setup --no-system took {took:.1f} s")


@pytest.mark.timeout(60)
def test_an_unknown_option_is_named_in_one_line_and_exits_2(tree: Path) -> None:
    proc, _ = _run([str(tree / "scripts" / "setup"), "--no-sytem"], tree, _env(), timeout=30)
    assert proc.returncode == 2 and proc.stdout == "", _said(proc)
    assert proc.stderr.count("\n") == 1 and "--no-sytem" in proc.stderr, _said(proc)
    assert not (tree / ".venv").exists()


@pytest.mark.timeout(60)
def test_help_says_what_setup_does_and_its_options_and_environment(tree: Path) -> None:
    proc, _ = _run([str(tree / "scripts" / "setup"), "--help"], tree, _env(), timeout=30)
    assert proc.returncode == 0 and proc.stderr == "", _said(proc)
    for word in (".venv", "torch 2.13.0", "chromium", "slurm", "--no-system", "PYTHON", "FFCTL_TORCH_INDEX_URL",
                 "FFCTL_APT_LOCK_TIMEOUT"):
        assert word in proc.stdout, (word, proc.stdout)
    assert not (tree / ".venv").exists()
    bad, _ = _run([str(tree / "scripts" / "setup")], tree, _env(FFCTL_APT_LOCK_TIMEOUT="soon"), timeout=30)
    assert bad.returncode == 2 and "FFCTL_APT_LOCK_TIMEOUT" in bad.stderr, _said(bad)


@pytest.mark.timeout(60)
def test_a_venv_that_cannot_be_made_still_fails_setup(tree: Path) -> None:
    """The required part stays required: no apt (--no-system) and no Python to make .venv with."""
    proc, _ = _run([str(tree / "scripts" / "setup"), "--no-system"], tree,
                   _env(PYTHON=str(tree / "no-such-python")), timeout=30)
    assert proc.returncode == 1, _said(proc)
    assert re.search(r"^setup: failed: could not make \.venv .*python3-venv", proc.stderr, re.M), _said(proc)
    assert not (tree / ".venv").exists()
