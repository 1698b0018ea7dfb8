"""The ranks' console output, as torchrun shows it: each line of a rank's log, prefixed `[rank N]:`.

Every rank writes its output to its own logs in the run record (stdout to
`logs/<node>/<rank>.log`, stderr to `logs/<node>/<rank>.err`, as torchrun keeps a rank's
`stdout.log` and `stderr.log`); while the job runs, `RankEcho` follows those logs and hands each
complete new line to the console, a stdout line to stdout and a stderr line to stderr, optionally only for the local ranks torchrun's `--local-ranks-filter` names. Logs the
record does not hold (ranks on hosts reached over SSH keep theirs there) are not followed.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from pathlib import Path

POLL_S = 0.2
MAX_LINE = 4000  # a longer line is cut: one runaway print must not flood the console


def parse_ranks_filter(raw: str) -> frozenset[int] | None:
    """torchrun's `--local-ranks-filter` (`0,1,...`): the local ranks to show; None for all."""
    text = raw.strip()
    if not text:
        return None
    ranks = set()
    for part in text.split(","):
        part = part.strip()
        if not (part.isascii() and part.isdigit()):
            raise ValueError(f"--local-ranks-filter {raw!r}: use LOCAL_RANK,LOCAL_RANK,...")
        ranks.add(int(part))
    return frozenset(ranks)


class RankEcho:
    """Follow `<logs>/<node>/<rank>.log` and `.err` and write each new line as `[rank N]: line`
    (a stderr line through `write_err`, when given)."""

    def __init__(self, logs: Path, write: Callable[[str], None], nproc_per_node: int,
                 local_ranks: Collection[int] | None = None,
                 write_err: Callable[[str], None] | None = None, role: str | None = None) -> None:
        self.logs = logs
        self.write = write
        # torchrun's `--tee` prefix, `[<role><local rank>]:` (`[default0]:`), when the user asked
        # for torchrun's tee; else `[rank <global rank>]:`, which stays unambiguous across nodes.
        self.role = role
        self.write_err = write if write_err is None else write_err
        self.nproc_per_node = nproc_per_node
        self.local_ranks = None if local_ranks is None else frozenset(local_ranks)
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-echo", daemon=True)

    def __enter__(self) -> RankEcho:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.poll(final=True)  # what the ranks wrote last

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except OSError:
                pass  # the record being created or removed: try again next time

    def _prefix(self, rank: int) -> str:
        if self.role is not None:
            return f"[{self.role}{rank % self.nproc_per_node}]:"  # torchrun's, no space after it
        return f"[rank {rank}]: "

    def _shown(self, rank: int) -> bool:
        return self.local_ranks is None or rank % self.nproc_per_node in self.local_ranks

    def poll(self, final: bool = False) -> None:
        """Write the complete lines added to every rank's log since the last poll (and, when
        `final`, a last line without its newline)."""
        if not self.logs.is_dir():
            return
        for path in sorted([*self.logs.glob("*/*.log"), *self.logs.glob("*/*.err")]):
            if not path.stem.isdigit() or not self._shown(int(path.stem)):
                continue
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    data = fh.read(1 << 20)
            except OSError:
                continue
            self._offsets[path] = start + len(data)
            data = self._partial.pop(path, b"") + data
            lines = data.split(b"\n")
            rest = lines.pop()
            if rest and final:
                lines.append(rest)
            elif rest:
                self._partial[path] = rest
            write = self.write_err if path.suffix == ".err" else self.write
            for line in lines:
                text = line.decode("utf-8", errors="replace").rstrip("\r")[:MAX_LINE]
                write(f"{self._prefix(int(path.stem))}{text}")
