"""A local unprivileged user against a run's shared memory.

The attacker (uid `nobody`, in a forked child) plants 0666 files and symlinks under every name in
/dev/shm a run could be expected to use (the slot, lock, FIFO and fault-file names, and the run's
directory itself when its key is handed to it), then the run's code creates its slots, locks and
fault files as root. Nothing may be written into the attacker's files or through its symlinks,
and the attacker may read nothing of the run. `revert --all` removes what a dead run left.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from fault_injectors.plan import NodePlace, RankPlace, Topology
from ffctl.agent.workers import shm_full
from fault_injectors.process import in_step_command
from recovery.faults import InStepFaults
from recovery.slots import SlotWriter, claim_node, read_slot, release_node
from recovery.snapshot import StateEntry, capture
from runs import shm
from tests.helpers.launch import processes_in, run_ffctl, start_launch, stop_at_end, wait_step

NOBODY = 65534
RANKS, NODES = 4, 2

# Jobs launched while another user plants files in shared memory.
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the attacker is uid nobody, set with setuid"), pytest.mark.timeout(600)]


def as_nobody(action: Callable[[], object]) -> object:
    """Run `action` in a forked child as uid/gid nobody; its JSON-able result (or the exception's
    repr, as {"error": ...})."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, act, report, leave without cleanup handlers
        code = 0
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out: object = action()
        except BaseException as exc:  # reported to the parent
            out, code = {"error": repr(exc)}, 1
        os.write(write_fd, json.dumps(out).encode())
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return json.loads(data or b"null")


def old_names(run_id: str) -> list[str]:
    """Every name in /dev/shm a run used to create or open there (predictable from its id)."""
    names = [f"ffctl-{run_id}-n{n}-r{r}-s{s}" for n in range(NODES) for r in range(RANKS) for s in (0, 1)]
    names += [f"ffctl-{run_id}-n{n}.lock" for n in range(NODES)]
    names += [f"ffctl-{run_id}-n{n}.spares" for n in range(NODES)]
    names += [f"ffctl-{run_id}-fault-r{r}" for r in range(RANKS)]
    return names


class Plants:
    """What the attacker planted: its own 0666 files (which must stay empty), symlinks to a
    root-only 0600 file and to a 0666 file of its own (whose content must not change)."""

    def __init__(self, run_id: str, victim_dir: Path) -> None:
        self.run_id = run_id
        self.loot_dir = Path(shm.SHM_ROOT) / f"attacker-{uuid.uuid4().hex[:8]}"
        self.victim = victim_dir / "root-only"
        self.victim.write_bytes(b"root's own bytes")
        self.victim.chmod(0o600)
        self.paths = [Path(shm.SHM_ROOT) / name for name in old_names(run_id)]

    def plant(self, extra: list[Path] = ()) -> None:  # type: ignore[assignment]
        loot_dir, victim, paths = self.loot_dir, self.victim, self.paths + list(extra)

        def attack() -> list[str]:
            os.mkdir(loot_dir, 0o777)
            os.chmod(loot_dir, 0o777)
            loot = loot_dir / "loot"
            fd = os.open(loot, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            os.write(fd, b"attacker's own bytes")
            os.fchmod(fd, 0o666)
            os.close(fd)
            planted = []
            for i, path in enumerate(paths):
                if i % 3 == 0:
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                    os.chmod(path, 0o666)
                else:
                    os.symlink(victim if i % 3 == 1 else loot, path)
                planted.append(str(path))
            return planted

        out = as_nobody(attack)
        assert isinstance(out, list) and len(out) == len(paths), out

    def assert_untouched(self) -> None:
        assert self.victim.read_bytes() == b"root's own bytes"
        assert (self.loot_dir / "loot").read_bytes() == b"attacker's own bytes"
        for path in self.paths:
            st = path.lstat()
            assert st.st_uid == NOBODY, path
            if not path.is_symlink():
                assert st.st_size == 0, f"{path} was written to"

    def remove(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.loot_dir, ignore_errors=True)


@pytest.fixture
def plants(tmp_path: Path) -> Iterator[Plants]:
    planted = Plants(f"sec-{uuid.uuid4().hex[:6]}", tmp_path)
    try:
        yield planted
    finally:
        planted.remove()
        for path in shm.own_run_dirs(run_id=planted.run_id):
            shm.remove_run_dir(path)


def _entries() -> list[StateEntry]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    return [StateEntry("model", model.state_dict, model.load_state_dict, True),
            StateEntry("rng", torch.get_rng_state, torch.set_rng_state, False)]


def _try_read(run_dir: str) -> dict[str, list[str]]:
    """As the attacker: list the run's directory, open and read its files, write into it."""
    outcome: dict[str, list[str]] = {"read": [], "denied": []}
    try:
        names = os.listdir(run_dir)
        outcome["read"].append(f"listed {names}")
    except PermissionError:
        outcome["denied"].append("list")
        names = []
    guesses = set(names) | {f"ffctl-{shm.parse_run_dir(Path(run_dir).name)}-n0-r0-s0"}
    for name in guesses:
        try:
            with open(Path(run_dir) / name, "rb") as fh:
                outcome["read"].append(f"{name}: {len(fh.read())} bytes")
        except (PermissionError, FileNotFoundError):
            outcome["denied"].append(name)
    try:
        os.close(os.open(Path(run_dir) / "planted", os.O_WRONLY | os.O_CREAT, 0o666))
        outcome["read"].append("created a file in it")
    except PermissionError:
        outcome["denied"].append("create")
    return outcome


def test_planted_files_and_symlinks_are_never_written_and_slots_never_readable(plants: Plants) -> None:
    run_id = plants.run_id
    run_dir = shm.new_run_dir(run_id)
    plants.plant()
    fds = [claim_node(run_dir, run_id, n) for n in range(NODES)]
    writers = [SlotWriter(run_dir, run_id, r // 2, r) for r in range(RANKS)]
    entries = _entries()
    try:
        for step in (1, 2):  # both slots of every rank
            for r, writer in enumerate(writers):
                writer.begin(capture(entries, step, r, RANKS))
                writer.fence()
        assert all(read_slot(w.paths[1]) is not None for w in writers)
        st = os.lstat(run_dir)
        assert st.st_uid == 0 and (st.st_mode & 0o777) == 0o700
        # An in-step fault, written by the injector's own command, reaches the rank's reader.
        topo = Topology(run_id, (NodePlace(0, "localhost", "127.0.0.1", 1),),
                        (RankPlace(1, 0, os.getpid()),), fault_dir=run_dir)
        handler = signal.signal(signal.SIGUSR1, lambda *_: None)
        try:
            cmd = in_step_command(topo, 1, "crash-rank:exception")
            assert subprocess.run(cmd.argv, capture_output=True, timeout=30).returncode == 0
        finally:
            signal.signal(signal.SIGUSR1, handler)
        faults = InStepFaults(run_dir, run_id, 1)
        faults.pending = True
        with pytest.raises(RuntimeError, match="crash-rank"):
            faults.check()
        outcome = as_nobody(lambda: _try_read(run_dir))
        assert isinstance(outcome, dict) and outcome["read"] == [], outcome
        assert "list" in outcome["denied"] and "create" in outcome["denied"]
    finally:
        for w in writers:
            w.close()
        for n, fd in enumerate(fds):
            release_node(run_dir, run_id, n, fd)
        shm.remove_run_dir(Path(run_dir))
    plants.assert_untouched()


@pytest.mark.parametrize("how", ["symlink", "directory"])
def test_a_run_directory_made_by_someone_else_is_refused(plants: Plants, how: str) -> None:
    """Were the key to leak before the run made its directory, whatever the attacker put under
    the name (a symlink to a directory of its own, a world-writable directory) is refused."""
    run_id = plants.run_id
    run_dir = Path(shm.new_run_dir(run_id))
    plants.plant()

    def squat() -> str:
        if how == "symlink":
            os.symlink(plants.loot_dir, run_dir)
        else:
            os.mkdir(run_dir, 0o777)
            os.chmod(run_dir, 0o777)
        return "ok"

    assert as_nobody(squat) == "ok"
    try:
        with pytest.raises(shm.UnsafeShm):
            claim_node(str(run_dir), run_id, 0)
        with pytest.raises(shm.UnsafeShm):
            SlotWriter(str(run_dir), run_id, 0, 0)
        assert sorted(p.name for p in plants.loot_dir.iterdir()) == ["loot"]
    finally:
        if run_dir.is_symlink():
            run_dir.unlink()
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    plants.assert_untouched()


def test_inside_the_directory_nothing_is_followed_or_reused(tmp_path: Path) -> None:
    """Defence in depth: even in the run's own directory, a symlink or a file of another user
    under a slot's name is refused, and a fault file's name is replaced, never written through."""
    run_dir = shm.ensure_private_dir(tmp_path / "run")
    victim = tmp_path / "victim"
    victim.write_bytes(b"intact")
    writer = SlotWriter(str(run_dir), "r", 0, 0)
    Path(writer.paths[1]).symlink_to(victim)
    with pytest.raises(shm.UnsafeShm):
        writer.begin(capture(_entries(), 1, 0, 1))
    Path(writer.paths[1]).unlink()
    os.close(os.open(writer.paths[1], os.O_WRONLY | os.O_CREAT, 0o666))
    os.chown(writer.paths[1], NOBODY, NOBODY)
    with pytest.raises(shm.UnsafeShm):
        writer.begin(capture(_entries(), 1, 0, 1))
    writer.close()
    fault = Path(shm.fault_path(str(run_dir), "r", 0))
    fault.symlink_to(victim)
    topo = Topology("r", (NodePlace(0, "localhost", "127.0.0.1", 1),), (RankPlace(0, 0, os.getpid()),),
                    fault_dir=str(run_dir))
    handler = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        assert subprocess.run(in_step_command(topo, 0, "gpu-xid").argv, timeout=30).returncode == 0
    finally:
        signal.signal(signal.SIGUSR1, handler)
    # The fault went into a file of its own beside the planted link, which nothing wrote through.
    (dropped,) = shm.mailbox(fault)
    assert victim.read_bytes() == b"intact" and fault.is_symlink() and not dropped.is_symlink()
    assert dropped.read_text() == "gpu-xid"


def test_revert_all_sweeps_a_dead_runs_shared_memory_and_says_what_it_removed(tmp_path: Path) -> None:
    """A run whose controller and agents were all SIGKILLed (mid kill-node, say) leaves its
    directory behind: `revert --all --run` removes it and names it; a live run's stays."""
    run_id = f"dead-{uuid.uuid4().hex[:6]}"
    dead = Path(shm.new_run_dir(run_id))
    live = Path(shm.new_run_dir(run_id))
    # A process that dies holding the node's claim, as an agent killed with its node does.
    child = subprocess.run([sys.executable, "-c", (
        "import sys; from recovery.slots import claim_node; from runs import shm\n"
        f"claim_node({str(dead)!r}, {run_id!r}, 1)\n"
        f"for r in (2, 3):\n"
        f"  for s in (0, 1):\n"
        f"    import os; os.close(shm.create_file(shm.slot_path({str(dead)!r}, {run_id!r}, 1, r, s)))\n"
    )], cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr
    held = claim_node(str(live), run_id, 0)  # this process lives: its run's directory stays
    try:
        out = run_ffctl(tmp_path, "inject", "revert", "--all", "--run", run_id, timeout=120)
        assert out.returncode == 0, out.stderr
        line = next(line for line in out.stdout.splitlines() if line.startswith("localhost:"))
        assert line == f"localhost: removed {dead} (run {run_id}, 4 snapshot slots)", out.stdout
        assert not dead.exists() and live.is_dir()
        # Nothing more to remove: the run is clean now.
        again = run_ffctl(tmp_path, "inject", "revert", "--all", "--run", run_id, timeout=120)
        assert "localhost: clean" in again.stdout.splitlines(), again.stdout
    finally:
        release_node(str(live), run_id, 0, held)
        shm.remove_run_dir(live)
        shutil.rmtree(dead, ignore_errors=True)


def test_a_real_launch_writes_nothing_of_the_attackers_and_leaves_nothing(plants: Plants, tmp_path: Path) -> None:
    """`ffctl launch` as root beside the attacker's plants: the job trains through an in-step
    fault and a kill, the attacker reads nothing while it runs, and once it ends neither its
    directory nor any file of its own is left in /dev/shm."""
    run_id = plants.run_id
    plants.plant()
    proc = start_launch(tmp_path, run_id, "--nnodes", "2", "--nproc-per-node", "1", "--steps", "100000",
                        "--model", "tiny", "--spares", "1", "--inject", "crash-rank:rank=1,step=5",
                        "--inject", "kill-rank:rank=0,step=10")
    with stop_at_end(proc, timeout=120) as stopped:
        wait_step(tmp_path / "runs", run_id, 14)
        dirs = [p for p in Path(shm.SHM_ROOT).iterdir() if shm.parse_run_dir(p.name) == run_id]
        assert len(dirs) == 1, dirs
        outcome = as_nobody(lambda: _try_read(str(dirs[0])))
        assert isinstance(outcome, dict) and outcome["read"] == [], outcome
    assert stopped.code == 130, stopped.stderr
    events = [json.loads(line) for line in (tmp_path / "runs" / run_id / "events.jsonl").read_text().splitlines()]
    recovered = [e for e in events if e["event"] == "recovery_decided"]
    assert len(recovered) >= 2, [e["event"] for e in events]
    plants.assert_untouched()
    def run_dirs() -> list[Path]:
        return [p for p in Path(shm.SHM_ROOT).iterdir() if shm.parse_run_dir(p.name) == run_id]

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and run_dirs():
        time.sleep(0.2)
    left = [p.name for p in Path(shm.SHM_ROOT).iterdir()
            if p.name.startswith(f"ffctl-{run_id}") and p not in plants.paths]
    assert left == [], left


@pytest.mark.parametrize("root_is", ["ours", "another user's", "world-writable", "a symlink"])
def test_a_hosts_run_directory_is_made_only_in_a_runs_root_of_ours(root_is: str, tmp_path: Path) -> None:
    """`--remote-runs-dir` (default /tmp/ffctl-runs) as the SSH backend prepares it on a host: in
    a root another user owns or can write, that user could swap the run's directory for a
    symlink and read or redirect its logs and checkpoints, so it is refused."""
    from ffctl.backends.ssh import MAKE_RUN_DIR

    root = tmp_path / "ffctl-runs"
    if root_is == "a symlink":
        (tmp_path / "elsewhere").mkdir()
        root.symlink_to(tmp_path / "elsewhere")
    elif root_is != "ours":
        root.mkdir()
        if root_is == "another user's":
            os.chown(root, NOBODY, NOBODY)
        else:
            root.chmod(0o1777)
    run_dir, log_dir = root / "run1", root / "run1" / "logs" / "0"
    made = subprocess.run(["sh", "-c", MAKE_RUN_DIR, "sh", str(root), str(run_dir), str(log_dir)],
                          capture_output=True, text=True, timeout=30)
    if root_is == "ours":
        assert made.returncode == 0, made.stdout + made.stderr
        assert (run_dir.stat().st_mode & 0o777) == 0o700 and log_dir.is_dir()
    else:
        assert made.returncode != 0 and not (tmp_path / "elsewhere" / "run1").exists(), made.stdout
        assert not run_dir.exists() or root_is == "a symlink"


def test_a_run_killed_whole_leaves_shared_memory_that_revert_all_removes_and_names(tmp_path: Path) -> None:
    """Controller, agents and ranks SIGKILLed at once (a host's processes all gone mid-run):
    the run's directory stays with its slots; `revert --all --run` removes it and says so."""
    run_id = f"whole-{uuid.uuid4().hex[:6]}"
    proc = start_launch(tmp_path, run_id, "--nnodes", "2", "--nproc-per-node", "1", "--steps", "100000",
                        "--model", "tiny")
    try:
        wait_step(tmp_path / "runs", run_id, 5)
        everyone = [proc.pid] + [p.pid for p in processes_in(tmp_path) if p.pid != proc.pid]
        for pid in everyone:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while processes_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.2)
    (left,) = [p for p in Path(shm.SHM_ROOT).iterdir() if shm.parse_run_dir(p.name) == run_id]
    slots = sorted(p.name for p in left.iterdir() if "-s" in p.name and not p.name.endswith(".lock"))
    assert slots, sorted(p.name for p in left.iterdir())
    try:
        out = run_ffctl(tmp_path, "inject", "revert", "--all", "--run", run_id, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"localhost: removed {left} (run {run_id}, {len(slots)} snapshot slots)" in out.stdout.splitlines(), \
            out.stdout
        assert not left.exists()
    finally:
        shutil.rmtree(left, ignore_errors=True)


def test_a_sigbus_beside_a_full_shared_memory_is_named_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank writing its snapshot slot into a full tmpfs gets SIGBUS, and nothing else says why:
    # the agent's report of the exit names the full filesystem and its free space.
    assert shm_full("/dev/shm/ffctl-r-KEY") is None  # this host's /dev/shm has room
    full = os.statvfs_result((4096, 4096, 65536, 3, 3, 100, 10, 10, 0, 255))  # 12 KiB free of 256 MiB
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    assert shm_full("/dev/shm/ffctl-r-KEY") == ("SIGBUS with /dev/shm full (0 MiB free of 256 MiB): "
                                                "a snapshot slot could not be written")
