"""Hostfiles: which hosts a multi-host run uses, and how many ranks each takes.

One host a line, in any of these forms (``#`` starts a comment, blank lines are ignored)::

    node1
    node1 slots=8            # DeepSpeed style
    alice@node1
    alice@node1:2222
    alice@node1:2222 slots=8
    alice@[fd00::5]:2222     # IPv6 literals go in brackets

A host name may be an alias from ``~/.ssh/config``; it is resolved when connecting, not here.
Every name ends up in an SSH command line and in error messages, so anything that is not a
plain host name (spaces, shell metacharacters, a leading ``-``) is refused here, with one line
naming the file, the line and the bad value.
"""
from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

USER_FILE_LIMIT = 1 << 20  # a hostfile or a scenario is a few lines; more is not one

# Letters, digits, '.', '-', '_' cover DNS names, IPv4 literals and ssh_config aliases; a leading
# '-' would read as an option to ssh or to a remote tool, so it is refused.
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_IPV6_RE = re.compile(r"^[0-9A-Fa-f:.]+$")
_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_KNOWN_KEYS = ("slots",)
_DIGITS_RE = re.compile(r"^[0-9]{1,9}$")  # ASCII only: str.isdigit() also accepts "²"


class HostfileError(ValueError):
    """A hostfile is unreadable or malformed; the message is one line naming file, line and value."""


@dataclass(frozen=True)
class HostEntry:
    """One host of a hostfile.

    ``user`` and ``port`` are None when the line does not give them: SSH then takes them from
    ``~/.ssh/config`` or its defaults. ``slots`` is None when not given: the caller applies
    ``--nproc-per-node``.
    """

    name: str
    user: str | None = None
    port: int | None = None
    slots: int | None = None
    line_no: int = 0

    @property
    def target(self) -> str:
        """``user@name:port`` as written (parts that were not given are left out)."""
        host = f"[{self.name}]" if ":" in self.name else self.name
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port is not None else ""
        return f"{user}{host}{port}"

    def __str__(self) -> str:
        return self.target


def read_user_file(path: str | Path, limit: int = USER_FILE_LIMIT) -> str:
    """The text of a file a user named (a hostfile, a scenario), at most `limit` bytes.

    Opened without blocking and checked to be a regular file before a byte is read: a FIFO, a
    device or a socket named by mistake (or on purpose) fails at once with an OSError saying so,
    instead of waiting forever for a writer. UnicodeDecodeError when it is not UTF-8."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "it is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a socket)")
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes")
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8")


def parse_hostfile(path: str | Path) -> list[HostEntry]:
    """Read and parse a hostfile; raises HostfileError (one line) on any problem."""
    p = Path(path)
    try:
        text = read_user_file(p)
    except FileNotFoundError:
        raise HostfileError(f"{p}: hostfile not found") from None
    except UnicodeDecodeError:
        raise HostfileError(f"{p}: hostfile is not UTF-8 text") from None
    except OSError as exc:
        raise HostfileError(f"{p}: cannot read hostfile: {exc.strerror or exc}") from None
    return parse_hostfile_text(text, str(p))


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[HostEntry]:
    """Parse hostfile text; ``source`` names it in error messages."""
    entries: list[HostEntry] = []
    first_seen: dict[tuple[str, int | None], int] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry = _parse_line(line, line_no, source)
        # The same machine twice would double its ranks silently; two ports on one name are
        # two sshds (containers), which is legitimate.
        key = (entry.name.lower(), entry.port)
        if key in first_seen:
            raise HostfileError(
                f"{source}:{line_no}: duplicate host {entry.target!r} "
                f"(already on line {first_seen[key]})"
            )
        first_seen[key] = line_no
        entries.append(entry)
    if not entries:
        raise HostfileError(f"{source}: no hosts in hostfile (it is empty or only comments)")
    return entries


def _parse_line(line: str, line_no: int, source: str) -> HostEntry:
    where = f"{source}:{line_no}"
    words = line.split()
    spec, options = words[0], words[1:]
    user, name, port = _parse_target(spec, where)

    slots: int | None = None
    seen_keys: set[str] = set()
    for word in options:
        if "=" not in word:
            raise HostfileError(
                f"{where}: unexpected {word!r} after host {spec!r} "
                "(host names cannot contain spaces; options are key=value)"
            )
        key, value = word.split("=", 1)
        if key not in _KNOWN_KEYS:
            raise HostfileError(f"{where}: unknown key {key!r} (known: {', '.join(_KNOWN_KEYS)})")
        if key in seen_keys:
            raise HostfileError(f"{where}: {key!r} given twice")
        seen_keys.add(key)
        slots = _parse_positive(value, "slots", where)
    return HostEntry(name=name, user=user, port=port, slots=slots, line_no=line_no)


def _parse_target(spec: str, where: str) -> tuple[str | None, str, int | None]:
    user: str | None = None
    rest = spec
    if "@" in spec:
        user, rest = spec.rsplit("@", 1)
        if not _USER_RE.match(user):
            raise HostfileError(f"{where}: bad user name {user!r} in {spec!r}")

    port_text: str | None = None
    if rest.startswith("["):
        # [v6-literal] or [v6-literal]:port
        close = rest.find("]")
        if close < 0:
            raise HostfileError(f"{where}: unclosed '[' in {spec!r}")
        name, tail = rest[1:close], rest[close + 1 :]
        if not name or not _IPV6_RE.match(name):
            raise HostfileError(f"{where}: bad IPv6 address {name!r} in {spec!r}")
        if tail:
            if not tail.startswith(":"):
                raise HostfileError(f"{where}: unexpected {tail!r} after ']' in {spec!r}")
            port_text = tail[1:]
    else:
        name = rest
        if ":" in rest:
            name, port_text = rest.split(":", 1)
        if not _NAME_RE.match(name):
            raise HostfileError(
                f"{where}: bad host name {name!r} "
                "(letters, digits, '.', '-' and '_' only, not starting with '-')"
            )

    port = None if port_text is None else _parse_port(port_text, where)
    return user, name, port


def _parse_port(text: str, where: str) -> int:
    if not _DIGITS_RE.match(text) or not 1 <= int(text) <= 65535:
        raise HostfileError(f"{where}: bad port {text!r} (expected 1-65535)")
    return int(text)


def _parse_positive(text: str, key: str, where: str) -> int:
    if not _DIGITS_RE.match(text) or int(text) < 1:
        raise HostfileError(f"{where}: bad {key} {text!r} (expected a positive integer)")
    return int(text)
