"""The append-only run store: `<runs-dir>/<run-id>/` with run.json, events.jsonl, logs/, report.json.

The controller is the only writer of events.jsonl. Each event is written as one line and fsync'd
before `append` returns, so a SIGKILLed controller leaves every event it reported intact; a torn
last line (killed mid-write) is skipped on read.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from runs.events import Event, EventKind, RunStatus

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DEFAULT_RUNS_DIR = "ffctl-runs"


class RunStoreError(Exception):
    """The run record cannot be created or read (bad run id, unwritable dir, unknown run)."""


def default_runs_dir() -> Path:
    return Path(os.environ.get("FFCTL_RUNS_DIR", DEFAULT_RUNS_DIR))


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def validate_run_id(run_id: str) -> str:
    if not RUN_ID_RE.match(run_id):
        raise RunStoreError(f"invalid run id {run_id!r}: use letters, digits, '.', '_' or '-'")
    return run_id


class RunStore:
    """One run's directory. Create with `create`, open an existing one with `open_run`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fh: Any = None

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

    @classmethod
    def create(cls, runs_dir: Path, run_id: str, run_info: dict[str, Any]) -> RunStore:
        validate_run_id(run_id)
        cls.check_writable(runs_dir)
        path = runs_dir / run_id
        try:
            runs_dir.mkdir(parents=True, exist_ok=True)
            path.mkdir()
        except FileExistsError:
            raise RunStoreError(f"run id {run_id!r} already exists in {str(runs_dir)!r}") from None
        except OSError as exc:
            raise RunStoreError(f"runs dir {str(runs_dir)!r} is not writable: {exc.strerror}") from None
        store = cls(path)
        (path / "logs").mkdir()
        # The job token authenticates the snapshot channel between agents: owner-only file.
        fd = os.open(store.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        store.write_json("run.json", run_info)
        return store

    def token(self) -> str:
        return self.token_path.read_text().strip()

    def write_json(self, name: str, obj: Any) -> None:
        """Atomically replace `name` (write to a temp file, fsync, rename)."""
        tmp = self.path / f".{name}.tmp"
        with open(tmp, "w") as fh:
            json.dump(obj, fh, indent=2, sort_keys=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path / name)

    def read_json(self, name: str) -> Any:
        return json.loads((self.path / name).read_text())

    def update_run_info(self, **fields: Any) -> None:
        info = self.read_json("run.json")
        info.update(fields)
        self.write_json("run.json", info)

    def append(self, kind: EventKind, /, t: float | None = None, **data: Any) -> Event:
        event = Event(kind=kind, t=time.time() if t is None else t, data=data)
        line = event.to_json() + "\n"
        with self._lock:
            if self._fh is None:
                self._fh = open(self.events_path, "a", buffering=1)
                # A record reopened after a kill may end in a torn line: start on a fresh one.
                if self._fh.tell() > 0 and not _ends_with_newline(self.events_path):
                    self._fh.write("\n")
            self._fh.write(line)
            self._fh.flush()
            os.fsync(self._fh.fileno())
        return event

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def events(self) -> list[Event]:
        return list(iter_events(self.events_path))

    def status(self) -> RunStatus:
        for event in reversed(self.events()):
            if event.kind is EventKind.RUN_FINISHED:
                return RunStatus(event.get("status"))
        return RunStatus.RUNNING


def iter_events(path: Path) -> Iterator[Event]:
    if not path.exists():
        return
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield Event.from_json(line)
            except (ValueError, KeyError):
                # A line torn by a kill mid-write: every complete line before it still counts.
                continue


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def open_run(runs_dir: Path, run_id: str) -> RunStore:
    validate_run_id(run_id)
    path = runs_dir / run_id
    if not (path / "run.json").exists():
        raise RunStoreError(f"unknown run {run_id!r} (no such run in {str(runs_dir)!r})")
    return RunStore(path)
