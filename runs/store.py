"""The append-only run store: `<runs-dir>/<run-id>/` with run.json, events.jsonl, logs/, report.json.

The controller is the only writer of events.jsonl. Each event is written as one line and fsync'd
before `append` returns, so a SIGKILLed controller leaves every event it reported intact (an
event appended with `sync=False`, high-rate progress such as every agent's memory-snapshot
report, is written at once but fsync'd with the next event that is: a fsync per agent per
second would cost the controller more time than it has at a thousand nodes); a torn
last line (killed mid-write) is skipped on read. A disk that refuses a line (full, over quota)
stops nothing: the line is taken back whole (the file truncated to where it began), the event
waits in memory with those after it (bounded: past the bound newer ones are counted and dropped,
and a `record_lost` event marks the gap), stderr says once that the record is behind, and each
later append writes the waiting ones first, in order; `close` writes them, or says exactly which
events the record lacks.

Two things the controller cannot write come from elsewhere when the record is read:
- what dead man's switches did: each one that reverted its fault appended a line to
  `logs/<node>/deadman.jsonl` on its host (`fault_injectors.deadman`); `events()` merges those
  lines in as `fault_reverted` events with `by: "deadman"`, at their time on the controller clock;
- whether the controller is still alive: run.json names its pid, host and process start time
  (`controller_identity`), and `controller_alive` checks them on this machine, so a run without
  `run_finished` whose controller is gone reads as `incomplete`, not `running`.
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import secrets
import socket
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator

from runs.events import Event, EventKind, RunStatus
from runs.metrics import run_status

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DEFAULT_RUNS_DIR = "ffctl-runs"
# What the dead man's switches of a node append to, in the node's log directory (the same name
# as fault_injectors.deadman.RECORD_NAME: this package imports nothing of fault_injectors).
DEADMAN_RECORD = "deadman.jsonl"
_DEADMAN_READ_MAX = 1 << 20  # a switch writes one short line per revert; more is not ours
# Process start times read twice can differ by a clock tick; a reused pid starts later than that.
_START_TOLERANCE_S = 1.0


class RunStoreError(Exception):
    """The run record cannot be created or read (bad run id, unwritable dir, unknown run)."""


class CorruptRecord(RunStoreError, ValueError):
    """A record file holds what ffctl never writes: bytes that are not UTF-8, a line that is not
    a JSON object, JSON nested too deeply to read. Unlike a line torn by a kill (skipped), the
    record cannot be trusted: `ffctl report` skips the run in a listing and refuses it by name.
    A ValueError too, so readers that tolerate a bad run.json tolerate this."""


def default_runs_dir() -> Path:
    return Path(os.environ.get("FFCTL_RUNS_DIR", DEFAULT_RUNS_DIR))


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def validate_run_id(run_id: object) -> str:
    """`run_id` if it can name a directory under the runs dir and nothing else: no separator, no
    `..`, no trailing newline (fullmatch: `$` would allow one), at most 128 characters."""
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) or ".." in run_id:
        shown = repr(run_id) if len(repr(run_id)) <= 200 else repr(run_id)[:197] + "..."
        raise RunStoreError(f"invalid run id {shown}: use letters, digits, '.', '_' or '-' (no '..'), "
                            "starting with a letter or digit, at most 128 characters")
    return run_id


GITIGNORE = "# Created by ffctl: run records (events, logs, the job token) stay out of version control.\n*\n"


def check_owned_dir(path: Path, what: str) -> None:
    """Refuse a directory ffctl would write into or read a secret from unless it is this user's
    (or root's) and nobody else can write to it: another user could otherwise rename what ffctl
    wrote and plant links in its place (a runs directory made 0777 by someone else before the
    launch). A link is refused too. (The run's shared-memory directory has its stricter check,
    `runs.shm.check_private_dir`: 0700 and the user's own.)"""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise RunStoreError(f"{what} {str(path)!r}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode) and what != "runs dir":
        raise RunStoreError(f"{what} {str(path)!r} is a symbolic link: refused")
    if stat.S_ISLNK(st.st_mode):  # the user's own link to a runs directory elsewhere: the target counts
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise RunStoreError(f"{what} {str(path)!r} is not a directory")
    if st.st_uid not in (os.geteuid(), 0):
        raise RunStoreError(f"{what} {str(path)!r} belongs to uid {st.st_uid}, not you: refused "
                            f"(its owner could replace what ffctl writes there)")
    # Group-writable only counts when the group is not the user's own (a private group, as
    # Debian and Ubuntu give each user, with umask 002).
    if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid()):
        raise RunStoreError(f"{what} {str(path)!r} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                            f"refused (chmod go-w it, or use another --runs-dir)")


def _ignore_in_version_control(runs_dir: Path) -> None:
    """Write `.gitignore` (everything) into a runs dir ffctl has just created in, often, the
    user's project, so its records and token never show as untracked files (as pytest and mypy
    do for their caches). A dir the user made is theirs: nothing is written into it."""
    try:
        fd = os.open(runs_dir / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError:
        return  # already there (theirs, or a race): it stands; the record does not depend on it
    with os.fdopen(fd, "w") as fh:
        fh.write(GITIGNORE)


class RunStore:
    """One run's directory. Create with `create`, open an existing one with `open_run`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._info_lock = threading.Lock()  # run.json's read-modify-write, within this process
        self._fd: int | None = None  # events.jsonl, opened for appending on the first event
        self._behind = _Backlog()  # events the disk has not taken yet (full, quota)

    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def token_path(self) -> Path:
        return self.path / "token"

    def log_path(self, node: int | str, rank: int | str) -> Path:
        return self.path / "logs" / str(node) / f"{rank}.log"

    @classmethod
    def check_writable(cls, runs_dir: Path) -> None:
        """Raise RunStoreError naming `runs_dir` when a run could not be recorded there."""
        probe = runs_dir
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
        if probe.exists() and not probe.is_dir():
            raise RunStoreError(f"runs dir {str(runs_dir)!r} is not a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise RunStoreError(f"runs dir {str(runs_dir)!r} is not writable")
        if probe == runs_dir:
            check_owned_dir(runs_dir, "runs dir")

    @classmethod
    def create(cls, runs_dir: Path, run_id: str, run_info: dict[str, Any]) -> RunStore:
        validate_run_id(run_id)
        cls.check_writable(runs_dir)
        path = runs_dir / run_id
        try:
            fresh = not runs_dir.exists()
            runs_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            if fresh:
                _ignore_in_version_control(runs_dir)
            path.mkdir(mode=0o755)
        except FileExistsError:
            raise RunStoreError(f"run id {run_id!r} already exists in {str(runs_dir)!r}") from None
        except OSError as exc:
            raise RunStoreError(f"runs dir {str(runs_dir)!r} is not writable: {exc.strerror}") from None
        store = cls(path)
        (path / "logs").mkdir(mode=0o755)
        # The job token authenticates the snapshot channel between agents: owner-only file.
        fd = os.open(store.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        store.write_json("run.json", run_info)
        return store

    def token(self) -> str:
        """The job token, read only from a file of this user's that nobody else can read or
        replace: the run's directory and the file itself are checked, and a link is refused."""
        check_owned_dir(self.path, "run dir")
        try:
            fd = os.open(self.token_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise RunStoreError(f"run {self.run_id!r}: cannot open its token file ({exc.strerror})") from None
        with os.fdopen(fd) as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise RunStoreError(f"run {self.run_id!r}: its token file is not a private file of yours "
                                    f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): refused")
            return fh.read(256).strip()

    def write_json(self, name: str, obj: Any) -> None:
        """Atomically replace `name` (write to a temp file of this write's own, fsync, rename):
        writers in two threads or processes never share a temp file, and the reader sees one
        whole version or the other."""
        fd, tmp = _exclusive_tmp(self.path, name)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(obj, fh, indent=2, sort_keys=False)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path / name)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk: the old file stays whole, no half-written one beside it
            raise

    def read_json(self, name: str) -> Any:
        """The JSON in `name`; CorruptRecord for anything that does not decode (not UTF-8, not
        JSON, nested too deeply), OSError if it cannot be read."""
        path = self.path / name
        try:
            with _open_regular(path) as fh:
                return _loads(fh.read().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise CorruptRecord(f"{path}: not UTF-8 (byte {exc.start})") from None
        except CorruptRecord as exc:
            raise CorruptRecord(f"{path}: {exc}") from None
        except ValueError as exc:
            raise CorruptRecord(f"{path}: not JSON ({exc})") from None

    def update_run_info(self, **fields: Any) -> None:
        """Set `fields` in run.json, keeping every other field: a read-modify-write under a lock
        (a thread's and a lock file's, so the controller's threads and another ffctl process
        writing the same run never lose each other's fields)."""
        with self._info_lock:
            fd = os.open(self.path / ".run.json.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                info = self.read_json("run.json")
                info.update(fields)
                self.write_json("run.json", info)
            finally:
                os.close(fd)  # releases the flock

    def append(self, kind: EventKind, /, t: float | None = None, sync: bool = True, **data: Any) -> Event:
        """Write one event as a line and fsync it (`sync=False`: written, and fsync'd with the
        next event that is). When the disk refuses (full, quota), the job
        goes on: the event waits in memory behind those already waiting (bounded, `_Backlog`),
        and every later append writes them again first, in order, once the disk takes them."""
        event = Event(kind=kind, t=time.time() if t is None else t, data=data)
        line = (event.to_json() + "\n").encode()
        with self._lock:
            # The older events first (and the note of any dropped); while the disk still refuses
            # them, this one waits behind them without another try.
            behind = self._behind.waiting() and not self._catch_up()
            self._behind.hold(event.kind.value, event.t, line, late=behind)
            if not behind:
                self._catch_up(sync)
        return event

    def _catch_up(self, sync: bool = True) -> bool:
        """Write what waits (lock held): the held lines, then a `record_lost` event for any that
        were dropped past the bounds. True when nothing is left waiting."""
        while True:
            if not self._write_held(sync):
                return False
            if not self._behind.dropped:
                self._behind.caught_up(self.events_path)
                return True
            self._behind.note_dropped()

    def _write_held(self, sync: bool = True) -> bool:
        """Write the held lines, one write each, and fsync them together (`sync=False`: not yet;
        a later fsync of the file covers them). A write or fsync that
        fails truncates the file back to where the batch began, so the record never holds a torn
        line (nor one the disk did not store), and the batch waits whole for the next try."""
        if not self._behind.lines:
            return True
        start: int | None = None
        try:
            if self._fd is None:
                self._fd = os.open(self.events_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
                # A record reopened after a kill may end in a torn line: start on a fresh one.
                if os.fstat(self._fd).st_size > 0 and not _ends_with_newline(self.events_path):
                    _write_all(self._fd, b"\n")
            start = os.fstat(self._fd).st_size
            for line in self._behind.lines:
                _write_all(self._fd, line)
            if sync or self._behind.failed_once:  # lines the disk refused before: known stored
                os.fsync(self._fd)
        except OSError as exc:
            if start is not None and self._fd is not None:
                try:
                    os.ftruncate(self._fd, start)  # giving space back does not need any
                except OSError:
                    pass
            self._behind.failed(self.events_path, exc)
            return False
        self._behind.written()
        return True

    def close(self) -> None:
        """Write what waits if the disk takes it now, else say exactly what the record lacks.
        Idempotent."""
        with self._lock:
            if self._behind.waiting() and not self._catch_up():
                self._behind.give_up(self.events_path)
            if self._fd is not None:
                try:
                    os.fsync(self._fd)  # lines appended with sync=False since the last fsync
                except OSError:
                    pass
                os.close(self._fd)
                self._fd = None

    def events(self, deadman: bool = True) -> list[Event]:
        """The record's events; with `deadman`, the dead man's switches' reverts merged in."""
        events = list(iter_events(self.events_path))
        if not deadman:
            return events
        return merge_deadman(events, read_deadman_lines(self.path))

    def controller_alive(self) -> bool | None:
        """Whether the run's controller still runs (None: this machine cannot tell)."""
        try:
            info = self.read_json("run.json")
        except (OSError, ValueError):
            return None
        return controller_alive(info if isinstance(info, dict) else {})

    def status(self) -> RunStatus:
        """How the run ended; `running` while its controller runs, `incomplete` once it is gone
        without having finished the record."""
        events = self.events(deadman=False)
        if any(event.kind is EventKind.RUN_FINISHED for event in events):
            return RunStatus(run_status(events))
        return RunStatus(run_status(events, self.controller_alive()))


# How much of the record may wait in memory while its disk is full: beyond either bound, newer
# events are counted by kind and dropped, and a `record_lost` event says so where they were.
BACKLOG_MAX_EVENTS = 100_000
BACKLOG_MAX_BYTES = 64 << 20


def _write_all(fd: int, data: bytes) -> None:
    """os.write until all of `data` is written (a full disk may take part of it, then refuse)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


@dataclass
class _Backlog:
    """The record's events the disk has not taken yet, in order and bounded, and what is said on
    stderr about them: once when the record falls behind, once when it caught up or gave up."""

    lines: list[bytes] = field(default_factory=list)
    size: int = 0
    # Events dropped past the bounds, by kind, and their time span: one `record_lost` event,
    # written after those that waited, says so where they were.
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_span: tuple[float, float] | None = None
    behind: bool = False
    failed_once: int = 0  # held lines that a write already failed for (the first ones)
    late: int = 0  # events written late since the record fell behind
    lost: int = 0  # ... and dropped
    error: str = ""

    def waiting(self) -> bool:
        return bool(self.lines or self.dropped)

    def hold(self, kind: str, t: float, line: bytes, late: bool = False) -> None:
        """Queue `line`; `late`: it waits behind lines the disk has just refused again."""
        if self.dropped or len(self.lines) >= BACKLOG_MAX_EVENTS or self.size + len(line) > BACKLOG_MAX_BYTES:
            # Newer events are dropped, never older ones: what is kept stays in order, and the
            # gap is in one place. Once one is dropped, all are until the disk takes the rest.
            self.dropped[kind] = self.dropped.get(kind, 0) + 1
            self.dropped_span = (self.dropped_span[0] if self.dropped_span else t, t)
            return
        self.lines.append(line)
        self.size += len(line)
        if late:
            self.failed_once = len(self.lines)

    def failed(self, path: Path, exc: OSError) -> None:
        self.error = exc.strerror or str(exc)
        self.failed_once = len(self.lines)
        if not self.behind:
            self.behind = True
            _say(f"the run record {path} is behind ({self.error}): the job goes on, its events wait in memory "
                 f"(up to {BACKLOG_MAX_EVENTS} events or {BACKLOG_MAX_BYTES >> 20} MiB) until the disk takes them")

    def written(self) -> None:
        self.late += self.failed_once
        self.failed_once = 0
        self.lines, self.size = [], 0

    def note_dropped(self) -> None:
        """Hold the `record_lost` event for the events dropped (the next write takes it)."""
        first, last = self.dropped_span or (0.0, 0.0)
        count = sum(self.dropped.values())
        gap = Event(EventKind.RECORD_LOST, last, {"lost": count, "kinds": dict(self.dropped),
                                                  "first_t": first, "last_t": last, "error": self.error})
        self.lost += count
        self.dropped, self.dropped_span = {}, None
        self.lines.append((gap.to_json() + "\n").encode())
        self.size += len(self.lines[-1])

    def caught_up(self, path: Path) -> None:
        if self.behind:
            lost = f"{self.lost} lost (a record_lost event marks where)" if self.lost else "none lost"
            _say(f"the run record {path} caught up: {self.late} event(s) written late, {lost}")
        self.behind, self.late, self.lost = False, 0, 0

    def give_up(self, path: Path) -> None:
        """The end, and the disk still refuses: say exactly which events the record lacks."""
        kinds: dict[str, int] = dict(self.dropped)
        times: list[float] = list(self.dropped_span or ())
        for line in self.lines:
            raw = json.loads(line)  # our own lines
            if raw["event"] == EventKind.RECORD_LOST.value:
                for kind, n in raw["kinds"].items():
                    kinds[kind] = kinds.get(kind, 0) + n
                times += [raw["first_t"], raw["last_t"]]
            else:
                kinds[raw["event"]] = kinds.get(raw["event"], 0) + 1
                times.append(raw["t"])
        _say(f"the run record {path} is incomplete ({self.error}): {_count_kinds(kinds)} from "
             f"{_clock(min(times))} to {_clock(max(times))} could not be written")
        self.lines, self.size, self.dropped, self.dropped_span = [], 0, {}, None
        self.behind = False


def _count_kinds(kinds: dict[str, int]) -> str:
    """`12 event(s) (step x10, failure_detected x2)`."""
    parts = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda item: (-item[1], item[0])))
    return f"{sum(kinds.values())} event(s) ({parts})"


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int((t % 1) * 1000):03d}"


def _say(line: str) -> None:
    """One line on stderr (the live view, on stdout, stays whole)."""
    try:
        sys.stderr.write(f"ffctl: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # no stderr to say it on: the record itself is what matters


def _exclusive_tmp(directory: Path, name: str) -> tuple[int, Path]:
    """A new temp file beside `name`, created by this call alone (O_EXCL, never through a link)."""
    while True:
        tmp = directory / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue


def _open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file: opened without blocking, so a FIFO
    planted as a record file (in a runs dir others can write) is refused, never waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptRecord(f"{path}: not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        # The decoder recurses once per nesting level: 100,000 brackets exhaust the stack.
        raise CorruptRecord("JSON nested too deeply") from None


def iter_events(path: Path) -> Iterator[Event]:
    """The events of an events.jsonl. A line torn by a kill mid-write is skipped (every complete
    line before it still counts); what no writer of ours produces, even torn, raises
    CorruptRecord naming the line: bytes that are not UTF-8 (every line is ASCII JSON), a JSON
    value that is not an object, nesting too deep to decode."""
    if not path.exists():
        return
    with _open_regular(path) as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as exc:
                raise CorruptRecord(f"{path}: line {n} is not UTF-8 (byte {exc.start})") from None
            if not line:
                continue
            try:
                obj = _loads(line)
            except CorruptRecord as exc:
                raise CorruptRecord(f"{path}: line {n}: {exc}") from None
            except ValueError:
                continue  # torn
            if not isinstance(obj, dict):
                raise CorruptRecord(f"{path}: line {n} is not a JSON object")
            try:
                yield Event(kind=EventKind(obj.pop("event")), t=float(obj.pop("t")), data=obj)
            except (ValueError, KeyError, TypeError):
                continue  # an event kind this version does not know, or no time: not ours to read


def read_deadman_lines(run_path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(node, line) for every well-formed line of `logs/<node>/deadman.jsonl` in a run directory.

    Lines that are not a JSON object with a fault id (torn, foreign) are skipped.
    """
    found: list[tuple[str, dict[str, Any]]] = []
    for path in sorted((run_path / "logs").glob(f"*/{DEADMAN_RECORD}")):
        try:
            with _open_regular(path) as fh:
                text = fh.read(_DEADMAN_READ_MAX).decode("utf-8", "replace")
        except (OSError, CorruptRecord):
            continue
        for line in text.splitlines():
            try:
                raw = _loads(line)
            except ValueError:  # CorruptRecord (nested too deeply) included
                continue
            if isinstance(raw, dict) and isinstance(raw.get("fault_id"), str) and raw["fault_id"]:
                found.append((path.parent.name, raw))
    return found


def _clock_offsets(events: Iterable[Event]) -> dict[str, float]:
    """node (as text) -> its clock minus the controller's, as the agents last reported it."""
    offsets: dict[str, float] = {}
    for ev in events:
        offset = ev.get("clock_offset_s")
        if ev.kind is EventKind.AGENT_STARTED and isinstance(offset, (int, float)) and math.isfinite(offset):
            offsets[str(ev.get("node"))] = float(offset)
    return offsets


def merge_deadman(events: list[Event], lines: list[tuple[str, dict[str, Any]]]) -> list[Event]:
    """`events` with one `fault_reverted` event (`by: "deadman"`) per switch line, in time order.

    A line's time is the target host's clock, brought to the controller's with the node's
    reported offset; a line without a usable time goes after every event. Pure: the record
    itself is never rewritten.
    """
    if not lines:
        return events
    offsets = _clock_offsets(events)
    last_t = events[-1].t if events else 0.0
    merged = list(events)
    seen: set[tuple[Any, ...]] = set()
    for node, raw in lines:
        t = raw.get("t")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
            t = float(t) - offsets.get(node, 0.0)
        else:
            t = last_t
        code = raw.get("exit")
        data: dict[str, Any] = {
            "fault_id": raw["fault_id"],
            "by": "deadman",
            "trigger": str(raw.get("trigger") or "timer"),
            "ok": raw.get("ok") is True,
            "exit": code if isinstance(code, int) and not isinstance(code, bool) else None,
            "node": int(node) if node.isdigit() else node,
        }
        key = (t, *sorted(data.items()))
        if key in seen:  # the same line twice (a log copied home over an older copy)
            continue
        seen.add(key)
        at = len(merged)
        while at > 0 and merged[at - 1].t > t:
            at -= 1
        merged.insert(at, Event(kind=EventKind.FAULT_REVERTED, t=t, data=data))
    return merged


def controller_identity() -> dict[str, Any]:
    """This process as run.json records its controller: pid, host and process start time."""
    import psutil

    return {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time()}


def controller_alive(info: dict[str, Any]) -> bool | None:
    """Is the controller run.json names alive? True or False when this machine can tell; None when
    it cannot (the controller ran on another host, or the record predates these fields).

    The start time guards against a reused pid; a zombie (killed, not yet reaped) is dead.
    """
    import psutil

    ctl = info.get("controller")
    if not isinstance(ctl, dict):
        return None
    pid, host, started = ctl.get("pid"), ctl.get("host"), ctl.get("started")
    if not (isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and isinstance(host, str)
            and isinstance(started, (int, float)) and not isinstance(started, bool)):
        return None
    if host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - float(started)) > _START_TOLERANCE_S:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return None


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def list_runs(runs_dir: Path) -> list[RunStore]:
    """The runs recorded under `runs_dir`, newest first: by their first event's time (when the
    controller started writing), else by run.json's; ties by run id. Directories that are not
    runs (no run.json, a name no run id can have) are skipped."""
    if not runs_dir.is_dir():
        return []
    found: list[tuple[float, str, RunStore]] = []
    for path in runs_dir.iterdir():
        if not RUN_ID_RE.fullmatch(path.name) or ".." in path.name:
            continue
        try:
            if not path.is_dir() or not (path / "run.json").is_file():
                continue
            store = RunStore(path)
            try:
                first = next(iter_events(store.events_path), None)
            except CorruptRecord:
                first = None  # listed all the same: its reader says what is wrong with it
            started = first.t if first is not None else (path / "run.json").stat().st_mtime
        except OSError:
            continue  # removed while listed, or unreadable: not a run to show
        found.append((started, path.name, store))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [store for _, _, store in found]


def open_run(runs_dir: Path, run_id: str) -> RunStore:
    validate_run_id(run_id)
    path = runs_dir / run_id
    if not (path / "run.json").exists():
        raise RunStoreError(f"unknown run {run_id!r} (no such run in {str(runs_dir)!r})")
    return RunStore(path)
