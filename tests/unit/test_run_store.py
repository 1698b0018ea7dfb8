"""The append-only run store (`runs.store`): layout, run ids, fsync'd appends and torn lines.

A run lives in `<runs-dir>/<run-id>/` with run.json, a 0600 token file, logs/ and events.jsonl.
Bad input (run id, runs dir, unknown run) is a `RunStoreError` with one line naming the value.
"""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from runs import store as store_mod
from runs.events import Event, EventKind, RunStatus
from runs.store import RunStore, RunStoreError, iter_events, open_run, validate_run_id

INFO: dict[str, Any] = {"spec": {"nnodes": 2, "nproc_per_node": 2}, "hosts": ["localhost"], "versions": {"ffctl": "0.1.0"}}


def one_line_naming(exc: pytest.ExceptionInfo[RunStoreError], value: str) -> None:
    message = str(exc.value)
    assert "\n" not in message
    assert value in message


# --------------------------------------------------------------------------------------------
# create
# --------------------------------------------------------------------------------------------


def test_create_makes_run_json_token_and_logs(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    st = RunStore.create(runs_dir, "r1", INFO)
    assert st.path == runs_dir / "r1"
    assert st.run_id == "r1"
    assert json.loads((st.path / "run.json").read_text()) == INFO
    assert st.read_json("run.json") == INFO
    assert (st.path / "logs").is_dir()
    assert st.log_path(1, 3) == st.path / "logs" / "1" / "3.log"
    # The job token: owner-only, random, readable back.
    mode = stat.S_IMODE(os.stat(st.token_path).st_mode)
    assert mode == 0o600
    token = st.token()
    assert len(token) == 64 and int(token, 16) >= 0
    other = RunStore.create(runs_dir, "r2", INFO)
    assert other.token() != token
    # No temp files left behind by the atomic write.
    assert sorted(p.name for p in st.path.iterdir()) == ["logs", "run.json", "token"]


def test_token_is_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        st = RunStore.create(tmp_path, "r1", INFO)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(st.token_path).st_mode) == 0o600


def test_create_makes_missing_parent_dirs(tmp_path: Path) -> None:
    runs_dir = tmp_path / "a" / "b" / "runs"
    st = RunStore.create(runs_dir, "r1", INFO)
    assert (runs_dir / "r1" / "run.json").is_file()
    assert st.events() == []
    assert st.status() is RunStatus.RUNNING


def test_update_run_info_keeps_other_fields(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    st.update_run_info(controller={"host": "127.0.0.1", "port": 29400})
    info = st.read_json("run.json")
    assert info["controller"] == {"host": "127.0.0.1", "port": 29400}
    assert info["hosts"] == INFO["hosts"]


def test_duplicate_run_id(tmp_path: Path) -> None:
    RunStore.create(tmp_path, "same-id", INFO)
    with pytest.raises(RunStoreError) as exc:
        RunStore.create(tmp_path, "same-id", {"other": True})
    one_line_naming(exc, "same-id")
    assert "already exists" in str(exc.value)
    # The first run's record is untouched.
    assert json.loads((tmp_path / "same-id" / "run.json").read_text()) == INFO


@pytest.mark.parametrize(
    "run_id",
    ["", "../escape", "a/b", ".hidden", "-flag", "has space", "semi;colon", "x" * 129, "tab\there"],
)
def test_invalid_run_id(tmp_path: Path, run_id: str) -> None:
    with pytest.raises(RunStoreError) as exc:
        RunStore.create(tmp_path, run_id, INFO)
    one_line_naming(exc, repr(run_id))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("run_id", ["r", "20261122-110320-a1b2c3", "exp_1.retry-2", "x" * 128])
def test_valid_run_ids(run_id: str) -> None:
    assert validate_run_id(run_id) == run_id


def test_new_run_ids_are_valid_and_distinct() -> None:
    ids = {store_mod.new_run_id() for _ in range(20)}
    assert len(ids) == 20
    for run_id in ids:
        assert validate_run_id(run_id) == run_id


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory")
def test_unwritable_runs_dir(tmp_path: Path) -> None:
    runs_dir = tmp_path / "ro"
    runs_dir.mkdir()
    runs_dir.chmod(0o555)
    try:
        with pytest.raises(RunStoreError) as exc:
            RunStore.create(runs_dir, "r1", INFO)
        one_line_naming(exc, str(runs_dir))
        assert "not writable" in str(exc.value)
        with pytest.raises(RunStoreError) as exc2:
            RunStore.create(runs_dir / "nested", "r1", INFO)
        one_line_naming(exc2, str(runs_dir / "nested"))
    finally:
        runs_dir.chmod(0o755)


def test_unwritable_runs_dir_when_mkdir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The permission check can pass and mkdir still fail (ACLs, read-only mounts)."""
    runs_dir = tmp_path / "runs"
    real_mkdir = Path.mkdir

    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        if self == runs_dir or runs_dir in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(RunStoreError) as exc:
        RunStore.create(runs_dir, "r1", INFO)
    one_line_naming(exc, str(runs_dir))
    assert "Permission denied" in str(exc.value)
    assert not runs_dir.exists()


def test_runs_dir_that_is_a_file(tmp_path: Path) -> None:
    runs_file = tmp_path / "runs"
    runs_file.write_text("not a dir\n")
    with pytest.raises(RunStoreError) as exc:
        RunStore.create(runs_file, "r1", INFO)
    one_line_naming(exc, str(runs_file))
    assert "not a directory" in str(exc.value)
    below = runs_file / "deeper"
    with pytest.raises(RunStoreError) as exc2:
        RunStore.create(below, "r1", INFO)
    one_line_naming(exc2, str(below))
    assert runs_file.read_text() == "not a dir\n"


def test_default_runs_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FFCTL_RUNS_DIR", raising=False)
    assert store_mod.default_runs_dir() == Path("ffctl-runs")
    monkeypatch.setenv("FFCTL_RUNS_DIR", str(tmp_path / "elsewhere"))
    assert store_mod.default_runs_dir() == tmp_path / "elsewhere"


# --------------------------------------------------------------------------------------------
# append and read back
# --------------------------------------------------------------------------------------------


def test_append_fsyncs_each_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    synced: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        # At fsync time the whole line has reached the OS: another reader sees it complete.
        with open(st.events_path) as fh:
            synced.append(len(fh.read().splitlines()))
        real_fsync(fd)

    monkeypatch.setattr(store_mod.os, "fsync", spy)
    for i in range(1, 4):
        st.append(EventKind.STEP, t=100.0 + i, step=i, loss=1.0 / i, gen=0)
        # Before append returns, the line is on disk and was fsync'd once.
        assert synced == list(range(1, i + 1))
        assert st.events_path.read_text().count("\n") == i
    st.close()


def test_append_round_trip(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    written = [
        st.append(EventKind.RUN_STARTED, t=10.0, world_size=4, strategy="peer"),
        st.append(EventKind.STEP, t=11.5, step=1, loss=0.1 + 0.2, step_time_s=1.5, gen=0, rank=0),
        st.append(EventKind.FAILURE_DETECTED, t=12.0, fault_ids=["f1"], cause="exit", ranks=[1],
                  nodes=[0], gen=0),
        st.append(EventKind.RUN_FINISHED, t=13.0, status=RunStatus.COMPLETED, steps_completed=1),
    ]
    st.close()
    back = st.events()
    assert [e.kind for e in back] == [e.kind for e in written]
    assert [e.t for e in back] == [10.0, 11.5, 12.0, 13.0]
    assert back[1].data == {"step": 1, "loss": 0.30000000000000004, "step_time_s": 1.5, "gen": 0, "rank": 0}
    assert back[2] == written[2]
    assert back[2].get("fault_ids") == ["f1"]
    assert back[3].get("status") == "completed"
    # One JSON object a line, kind and t first.
    lines = st.events_path.read_text().splitlines()
    assert len(lines) == 4
    first = json.loads(lines[1])
    assert list(first)[:2] == ["event", "t"]
    assert first["event"] == "step"
    # A second handle on the same run reads the same events.
    again = open_run(tmp_path, "r1")
    assert again.events() == back
    assert again.status() is RunStatus.COMPLETED


# FAULT_INJECTED and SNAPSHOT_TAKEN carry a `kind` field of their own (the fault kind, "memory" |
# "disk"); it must survive the round trip next to the event's own kind.


def test_fault_injected_event_survives_json() -> None:
    ev = Event(EventKind.FAULT_INJECTED, 12.0, {"fault_id": "f1", "kind": "kill-rank", "target": "rank:1"})
    back = Event.from_json(ev.to_json())
    assert back == ev


def test_snapshot_taken_event_survives_json() -> None:
    ev = Event(EventKind.SNAPSHOT_TAKEN, 3.0, {"step": 10, "kind": "disk", "ranks": [0, 1]})
    assert Event.from_json(ev.to_json()) == ev


def test_append_takes_a_fault_kind_and_reads_it_back(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    append: Any = st.append  # the `kind` keyword is the schema's fault kind
    append(EventKind.FAULT_INJECTED, t=12.0, fault_id="f1", kind="kill-rank", target="rank:1",
           ranks=[1], nodes=[0], at_step=1, emulated=False)
    st.close()
    (back,) = st.events()
    assert back.kind is EventKind.FAULT_INJECTED
    assert back.get("kind") == "kill-rank"


def test_append_stamps_the_current_time(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    before = time.time()
    ev = st.append(EventKind.SPARES_HELD, node=0, count=1)
    after = time.time()
    st.close()
    assert before <= ev.t <= after
    assert st.events()[0].t == ev.t


def test_append_after_close_reopens(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    st.append(EventKind.STEP, t=1.0, step=1)
    st.close()
    st.close()  # idempotent
    st.append(EventKind.STEP, t=2.0, step=2)
    st.close()
    assert [e.get("step") for e in st.events()] == [1, 2]


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    for i in range(1, 6):
        st.append(EventKind.STEP, t=float(i), step=i, loss=float(i))
    st.close()
    whole = Event(EventKind.STEP, 6.0, {"step": 6, "loss": 6.0}).to_json()
    with open(st.events_path, "a") as fh:
        fh.write(whole[: len(whole) // 2])  # killed mid-write: half a line, no newline
    events = st.events()
    assert [e.get("step") for e in events] == [1, 2, 3, 4, 5]
    assert list(iter_events(st.events_path)) == events


def test_torn_line_with_an_unknown_kind_or_no_time_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    good = Event(EventKind.STEP, 1.0, {"step": 1}).to_json()
    path.write_text(
        good + "\n"
        + "\n"  # blank line
        + json.dumps({"event": "no_such_kind", "t": 2.0}) + "\n"
        + json.dumps({"event": "step"}) + "\n"
        + good.replace("1.0", "3.0") + "\n"
        + '{"event": "st'
    )
    assert [e.t for e in iter_events(path)] == [1.0, 3.0]


def test_events_of_a_missing_file_is_empty(tmp_path: Path) -> None:
    assert list(iter_events(tmp_path / "nope.jsonl")) == []


def test_status_from_the_last_run_finished(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    st.append(EventKind.RUN_STARTED, t=1.0)
    assert st.status() is RunStatus.RUNNING
    st.append(EventKind.RUN_FINISHED, t=2.0, status="interrupted")
    assert st.status() is RunStatus.INTERRUPTED
    st.close()


# --------------------------------------------------------------------------------------------
# open_run
# --------------------------------------------------------------------------------------------


def test_open_run_unknown_id(tmp_path: Path) -> None:
    RunStore.create(tmp_path, "known", INFO)
    with pytest.raises(RunStoreError) as exc:
        open_run(tmp_path, "unknown-42")
    one_line_naming(exc, "unknown-42")


def test_open_run_of_a_dir_without_run_json(tmp_path: Path) -> None:
    (tmp_path / "half-made").mkdir()
    with pytest.raises(RunStoreError) as exc:
        open_run(tmp_path, "half-made")
    one_line_naming(exc, "half-made")


def test_open_run_invalid_id(tmp_path: Path) -> None:
    with pytest.raises(RunStoreError) as exc:
        open_run(tmp_path, "../../etc")
    one_line_naming(exc, "../../etc")


def test_open_run_checks_the_id_before_the_disk(tmp_path: Path) -> None:
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "run.json").write_text("{}")
    with pytest.raises(RunStoreError) as exc:
        open_run(tmp_path, ".hidden")
    one_line_naming(exc, "'.hidden'")
    assert "invalid run id" in str(exc.value)


def test_open_run_reads_an_existing_run(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    token = st.token()
    opened = open_run(tmp_path, "r1")
    assert opened.path == st.path
    assert opened.token() == token
    assert opened.read_json("run.json") == INFO


def test_append_after_a_torn_line_starts_a_fresh_line(tmp_path: Path) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    st.append(EventKind.STEP, t=1.0, step=1)
    st.close()
    with open(st.events_path, "a") as fh:
        fh.write('{"event": "st')  # a writer killed mid-line
    again = open_run(tmp_path, "r1")
    again.append(EventKind.STEP, t=2.0, step=2)
    again.close()
    assert [e.get("step") for e in again.events()] == [1, 2]


def test_an_event_appended_without_sync_is_written_at_once_and_fsynced_with_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = RunStore.create(tmp_path, "r1", INFO)
    syncs: list[int] = []
    real = os.fsync
    monkeypatch.setattr(store_mod.os, "fsync", lambda fd: (syncs.append(fd), real(fd))[1])
    st.append(EventKind.STEP, step=1)
    assert len(syncs) == 1
    st.append(EventKind.SNAPSHOT_TAKEN, sync=False, step=1, kind="memory", node=0, ranks=[0])
    assert len(syncs) == 1  # no fsync of its own...
    assert [e.kind for e in iter_events(st.events_path)] == [EventKind.STEP, EventKind.SNAPSHOT_TAKEN]  # ...but written
    assert "sync" not in next(e for e in st.events() if e.kind is EventKind.SNAPSHOT_TAKEN).data
    st.append(EventKind.STEP, step=2)
    assert len(syncs) == 2  # the next event's fsync covers both
    st.append(EventKind.SNAPSHOT_TAKEN, sync=False, step=2, kind="memory", node=0, ranks=[0])
    st.close()
    assert len(syncs) == 3  # closing fsyncs what the last unsynced event left
    assert len(list(iter_events(st.events_path))) == 4


def _update_many(path: str, prefix: str, count: int) -> None:
    store = RunStore(Path(path))
    for i in range(count):
        store.update_run_info(**{f"{prefix}{i}": i})


def test_concurrent_updates_of_run_info_lose_no_field(tmp_path: Path) -> None:
    """The controller's threads (its main loop, the Slurm node poller) and another ffctl process
    each set fields of run.json: a read-modify-write without a lock drops the others' fields,
    and two writers sharing one temp file write garbage."""
    import subprocess
    import sys
    import threading

    st = RunStore.create(tmp_path, "r1", {"run_id": "r1"})
    threads = [threading.Thread(target=_update_many, args=(str(st.path), f"t{n}_", 40)) for n in range(4)]
    root = str(Path(__file__).resolve().parents[2])
    code = "import sys; from tests.unit.test_run_store import _update_many; _update_many(*sys.argv[1:3], 40)"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(st.path), f"p{n}_"], cwd=root) for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    info = st.read_json("run.json")
    expected = {f"{who}{n}_{i}" for who, k in (("t", 4), ("p", 2)) for n in range(k) for i in range(40)}
    assert expected <= set(info) and info["run_id"] == "r1"
    assert not list(st.path.glob(".run.json*.tmp"))  # every write's own temp file renamed or removed


def test_a_runs_dir_ffctl_creates_ignores_itself_in_version_control(tmp_path: Path) -> None:
    # A user's project is a git checkout: its ffctl-runs/ (records, the job token) must not
    # show as untracked files. A runs dir the user made keeps what the user put there.
    runs_dir = tmp_path / "project" / "ffctl-runs"
    RunStore.create(runs_dir, "r1", INFO)
    assert (runs_dir / ".gitignore").read_text().splitlines()[-1] == "*"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    RunStore.create(theirs, "r1", INFO)
    assert not (theirs / ".gitignore").exists()
    (theirs / ".gitignore").write_text("keep\n")
    RunStore.create(theirs, "r2", INFO)
    assert (theirs / ".gitignore").read_text() == "keep\n"
