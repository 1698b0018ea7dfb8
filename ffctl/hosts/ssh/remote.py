"""SSH transport: runs commands and the node agent on remote hosts (with
`ffctl.hosts.ssh.connection`, the only paramiko users).

`SSHTransport` implements the `fault_injectors.transport.Transport` protocol over one SSH
connection per host, opened lazily (`ffctl.hosts.ssh.connection.open_client`: ``~/.ssh/config``,
the SSH agent, known_hosts checked as OpenSSH does) and reopened if it drops.

Commands are argv lists; each is turned into the single remote shell string with
``shlex.join``, so no host name, path or fault target can inject shell.

Long-running remote processes (the node agent) are started with `SSHTransport.start`: the remote
side is wrapped so that it dies, process group and all, when the SSH channel closes or the
connection is lost; `RemoteProcess.terminate` relies on that.

Every failure is an `SSHError` (a `TransportError`) whose message is one line starting with the
host it is about.
"""
from __future__ import annotations

import collections
import math
import re
import select
import shlex
import socket
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import paramiko

from fault_injectors.transport import CommandResult, Transport
from ffctl.hosts.hostfile import HostEntry
from ffctl.hosts.ssh.connection import (
    AuthFailed,
    HostKeyChanged,
    HostKeyUnknown,
    HostUnreachable,
    SSHError,
    SSHSettings,
    open_client,
    resolve_settings,
)

# The connection's errors are this transport's too: callers catch them from here.
__all__ = ["AuthFailed", "HostKeyChanged", "HostKeyUnknown", "HostUnreachable", "OutputLine", "RemoteCommandMissing",
           "RemoteProcess", "SSHError", "SSHSettings", "SSHTransport", "Stream", "require_command", "resolve_settings"]

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STARTED_MARKER = b"\036ffctl-remote-started "
_READ_CHUNK = 65536


# --------------------------------------------------------------------------------------------
# commands that must exist on the host


class RemoteCommandMissing(SSHError):
    """A command the caller needs is not installed on the host (the probe exited 127)."""

    def __init__(self, host: str, command: str, what: str | None = None) -> None:
        self.command = command
        self.what = what or command
        super().__init__(
            host, f"{self.what} is not installed there (`{command}` exited 127: command not found)"
        )


def require_command(
    transport: Transport, argv: Sequence[str], *, timeout: float, what: str | None = None
) -> CommandResult:
    """Run a probe such as ``["ffctl", "--version"]``; raise RemoteCommandMissing on exit 127.

    Any other result, success or not, is returned for the caller to judge.
    """
    result = transport.run(argv, timeout=timeout)
    if result.returncode == 127:
        raise RemoteCommandMissing(transport.host, shlex.join(argv), what)
    return result


# --------------------------------------------------------------------------------------------
# reading a channel


def _pump(
    chan: paramiko.Channel,
    deadline: float | None,
    on_stdout: Callable[[bytes], None],
    on_stderr: Callable[[bytes], None],
    stop: threading.Event | None = None,
) -> bool:
    """Copy the channel's output to the callbacks until EOF; False if the deadline passed first.

    One select() on the channel's pollable fd serves both streams, so a chatty stderr can never
    block stdout (or the other way round).
    """
    fd = chan.fileno()

    def drain() -> None:
        while chan.recv_ready():
            on_stdout(chan.recv(_READ_CHUNK))
        while chan.recv_stderr_ready():
            on_stderr(chan.recv_stderr(_READ_CHUNK))

    while True:
        drain()
        if chan.eof_received or chan.closed:
            drain()  # data that arrived between the first drain and the EOF
            return True
        if stop is not None and stop.is_set():
            return False
        wait = 0.5
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                return False
        select.select([fd], [], [], wait)


class Stream(str, Enum):
    STDOUT = "stdout"
    STDERR = "stderr"


@dataclass(frozen=True)
class OutputLine:
    """One line of a remote process's output, without its newline."""

    stream: Stream
    text: str


# The wrapper for long-running remote processes, run as `sh -c WRAPPER ffctl-remote GRACE CWD
# ARGV...` with the environment sent as K=V lines on stdin (ended by an empty line) so secrets
# never appear in a remote `ps`. Once the command is started it writes a marker line with the
# command's pid to stderr; `RemoteProcess` consumes that line. The command runs under `setsid`,
# so it leads its own process group and everything it starts stays in that group. A watcher holds the channel's stdin: when the channel closes or the
# connection is lost, stdin ends and the watcher sends TERM to the group, then KILL after GRACE
# tenths of a second. The wrapper itself is outside that group, so it survives to reap the
# command and report its real exit status (143 after a TERM).
_WRAPPER = r"""
while IFS= read -r kv && [ -n "$kv" ]; do export "$kv" || exit 126; done
grace=$1; cwd=$2; shift 2
if [ -n "$cwd" ]; then cd "$cwd" || exit 126; fi
for c in setsid "$1"; do
  command -v "$c" >/dev/null 2>&1 || { printf '%s: command not found\n' "$c" >&2; exit 127; }
done
exec 3<&0
setsid "$@" </dev/null 3<&- &
child=$!
printf '\036ffctl-remote-started %s\n' "$child" >&2
(
  cat <&3 >/dev/null
  kill -TERM "-$child" 2>/dev/null
  i=0
  while kill -0 "-$child" 2>/dev/null && [ "$i" -lt "$grace" ]; do sleep 0.1; i=$((i+1)); done
  kill -KILL "-$child" 2>/dev/null
) >/dev/null 2>&1 &
watcher=$!
exec 3<&-
wait "$child"; rc=$?
kill -KILL "$watcher" 2>/dev/null
exit "$rc"
"""


class RemoteProcess:
    """A long-running process on a remote host (normally the node agent).

    Output is read in the background; take it line by line with `read_line`. The process dies
    when `terminate` or `close` is called, when the transport closes, or when the connection is
    lost (the remote sshd then closes the channel, once it notices). A process that starts
    children in a new session (``setsid``) must stop them itself on SIGTERM.
    """

    def __init__(self, host: str, argv: Sequence[str], chan: paramiko.Channel) -> None:
        self.host = host
        self.argv = tuple(argv)
        self._chan = chan
        # the command's pid on the host, which is also its process group id
        self.remote_pid: int | None = None
        self._started = threading.Event()
        self._lines: collections.deque[OutputLine] = collections.deque()
        self._output_done = False
        self._cond = threading.Condition()  # guards _lines and _output_done
        self._stop = threading.Event()
        self._reader = threading.Thread(
            target=self._read, name=f"ssh-output-{host}", daemon=True
        )
        self._reader.start()

    def _read(self) -> None:
        partial = {Stream.STDOUT: b"", Stream.STDERR: b""}

        def put(line: OutputLine) -> None:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()

        def feed(stream: Stream) -> Callable[[bytes], None]:
            def take(data: bytes) -> None:
                buf = partial[stream] + data
                *complete, partial[stream] = buf.split(b"\n")
                for raw in complete:
                    if (
                        stream is Stream.STDERR
                        and not self._started.is_set()
                        and raw.startswith(_STARTED_MARKER)
                    ):
                        pid = raw[len(_STARTED_MARKER) :].strip()
                        self.remote_pid = int(pid) if pid.isdigit() else None
                        self._started.set()
                        continue
                    put(OutputLine(stream, raw.decode("utf-8", "replace").rstrip("\r")))

            return take

        try:
            _pump(self._chan, None, feed(Stream.STDOUT), feed(Stream.STDERR), self._stop)
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the channel died under us: what was read is kept, poll() says how it ended
        finally:
            for stream, rest in partial.items():
                if rest:
                    put(OutputLine(stream, rest.decode("utf-8", "replace")))
            with self._cond:
                self._output_done = True
                self._cond.notify_all()  # wakes a reader blocked in read_line

    def _wait_started(self, timeout: float) -> bool:
        """True once the wrapper has launched the command; False if it exited or time ran out."""
        deadline = time.monotonic() + timeout
        while not self._started.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._output_done:
                return self._started.is_set()
            self._started.wait(min(remaining, 0.05))
        return True

    @property
    def output_closed(self) -> bool:
        """True once both streams have ended and every line has been taken."""
        with self._cond:
            return self._output_done and not self._lines

    def read_line(self, timeout: float) -> OutputLine | None:
        """The next line from stdout or stderr, in arrival order; None on timeout or at the end."""
        with self._cond:
            self._cond.wait_for(lambda: self._lines or self._output_done, timeout)
            return self._lines.popleft() if self._lines else None

    def iter_lines(self, idle_timeout: float) -> Iterator[OutputLine]:
        """Lines until the output ends or none arrives for ``idle_timeout`` seconds."""
        while (line := self.read_line(idle_timeout)) is not None:
            yield line

    def poll(self) -> int | None:
        """The exit status, or None while running; -1 if killed by a signal or the link was lost."""
        if self._chan.exit_status_ready():
            return self._chan.recv_exit_status()
        if self._chan.closed:
            return -1
        return None

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the exit status (as in `poll`); None if still running."""
        deadline = time.monotonic() + timeout
        while (status := self.poll()) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._chan.status_event.wait(min(remaining, 0.2))
        return status

    def terminate(self, timeout: float = 10.0) -> int | None:
        """Stop the remote process and its process group; returns its status as `wait` does.

        Closing our end of stdin makes the remote watcher send SIGTERM, then SIGKILL after the
        grace period given to `SSHTransport.start`; the channel is then closed in any case.
        """
        status = self.poll()
        if status is None:
            try:
                self._chan.shutdown_write()
            except (OSError, EOFError, paramiko.SSHException):
                pass  # already gone: closing below is all that is left to do
            status = self.wait(timeout)
        self.close()
        return status

    def close(self) -> None:
        """Close the channel without waiting; the remote side then dies on its own."""
        self._stop.set()
        self._chan.close()
        self._reader.join(timeout=5.0)

    def __enter__(self) -> RemoteProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()


# Closing a channel does not stop a command that runs without a pty, so a command that outlives
# run()'s timeout would linger on the host. coreutils/busybox `timeout` (where the host has it)
# stops it a little after the caller has given up; exit statuses, 127 included, pass through.
_RUN_WRAPPER = 'if command -v timeout >/dev/null 2>&1; then exec timeout -k 2 "$@"; fi; shift; exec "$@"'


def _with_remote_timeout(argv: Sequence[str], timeout: float) -> str:
    seconds = str(max(1, math.ceil(timeout)) + 1)
    return shlex.join(["sh", "-c", _RUN_WRAPPER, "ffctl-run", seconds, *argv])


# --------------------------------------------------------------------------------------------
# the transport


class SSHTransport:
    """One host over SSH; implements the `Transport` protocol plus start/get_file/put_file."""

    def __init__(
        self,
        entry: HostEntry,
        *,
        accept_new_host_keys: bool = False,
        connect_timeout: float = 10.0,
        known_hosts: str | Path | None = None,
        ssh_config: str | Path | None = None,
        keepalive_s: float = 5.0,
    ) -> None:
        self.entry = entry
        self.host = entry.name
        self.accept_new_host_keys = accept_new_host_keys
        self.connect_timeout = connect_timeout
        self.keepalive_s = keepalive_s
        self._explicit_known_hosts = known_hosts is not None
        self.settings = resolve_settings(entry, ssh_config=ssh_config, known_hosts=known_hosts)
        self._client: paramiko.SSHClient | None = None
        self._lock = threading.Lock()

    # -- connection --------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the SSH connection is open now (it is opened on demand)."""
        client = self._client
        transport = client.get_transport() if client is not None else None
        return transport is not None and transport.is_active()

    def connect(self) -> None:
        """Open the connection now (it is otherwise opened by the first call that needs it)."""
        self._transport()

    def _transport(self) -> paramiko.Transport:
        with self._lock:
            if self._client is not None:
                transport = self._client.get_transport()
                if transport is not None and transport.is_active():
                    return transport
                self._client.close()  # the link dropped; reconnect (host key checked again)
                self._client = None
            self._client = open_client(self.settings, accept_new=self.accept_new_host_keys,
                                       connect_timeout=self.connect_timeout, keepalive_s=self.keepalive_s,
                                       system_known_hosts=not self._explicit_known_hosts)
            transport = self._client.get_transport()
            assert transport is not None
            return transport

    def close(self) -> None:
        """Close the connection; remote processes started with `start` die with it."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __enter__(self) -> SSHTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _session(self, timeout: float) -> paramiko.Channel:
        transport = self._transport()
        try:
            return transport.open_session(timeout=timeout)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            if not transport.is_active():
                raise HostUnreachable(self.settings.label, f"connection lost: {exc}") from None
            # The server said no: usually sshd's MaxSessions (10 channels per connection).
            raise SSHError(self.settings.label, f"sshd refused a new channel: {exc}") from None

    # -- Transport protocol ------------------------------------------------------------------

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        """Run argv to completion; a non-zero exit is a value (124 with a note on timeout)."""
        argv = tuple(argv)
        deadline = time.monotonic() + timeout
        chan = self._session(timeout)
        out: list[bytes] = []
        err: list[bytes] = []
        try:
            chan.settimeout(timeout)
            chan.exec_command(_with_remote_timeout(argv, timeout))
            if input is not None:
                chan.sendall(input.encode())
            # Always send EOF: a command that reads stdin must not wait for us forever.
            chan.shutdown_write()
            finished = _pump(chan, deadline, out.append, err.append)
            if finished:
                finished = chan.status_event.wait(max(0.0, deadline - time.monotonic()))
            if not finished:
                note = f"timed out after {timeout:g}s on {self.host}"
                return CommandResult(argv, 124, b"".join(out).decode("utf-8", "replace"), note)
            status = chan.recv_exit_status()
        except (socket.timeout, TimeoutError):
            return CommandResult(argv, 124, "", f"timed out after {timeout:g}s on {self.host}")
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise HostUnreachable(
                self.settings.label, f"connection lost while running `{shlex.join(argv)}`: {exc}"
            ) from None
        finally:
            chan.close()
        if status == -1:
            # No exit status: the remote command was killed by a signal or the link dropped.
            if not self.connected:
                raise HostUnreachable(
                    self.settings.label, f"connection lost while running `{shlex.join(argv)}`"
                )
            status = 255
        return CommandResult(
            argv, status, b"".join(out).decode("utf-8", "replace"), b"".join(err).decode("utf-8", "replace")
        )

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        """Start argv in a new session with no tie to the connection (a dead man's switch).

        Raises RemoteCommandMissing when argv[0] is not on the remote PATH.
        """
        argv = tuple(argv)
        if not argv:
            raise ValueError("spawn_detached needs a command")
        quoted = shlex.join(argv)
        script = (
            f"command -v {shlex.quote(argv[0])} >/dev/null 2>&1 || exit 127; "
            f"setsid nohup {quoted} </dev/null >/dev/null 2>&1 &"
        )
        result = self.run(["sh", "-c", script], timeout=timeout)
        if result.returncode == 127:
            raise RemoteCommandMissing(self.host, argv[0])
        if not result.ok:
            raise SSHError(self.host, f"cannot start `{quoted}`: {result.describe()}")

    # -- long-running processes and files ----------------------------------------------------

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        cwd: str | None = None,
        grace_s: float = 5.0,
        timeout: float = 30.0,
    ) -> RemoteProcess:
        """Start a long-running remote process whose output can be read line by line.

        ``env`` is added to the remote environment (sent over the channel, not the command
        line). The process and its process group get SIGTERM when the channel closes (see
        `RemoteProcess.terminate`) and SIGKILL ``grace_s`` later. Raises RemoteCommandMissing
        when argv[0] is not on the remote PATH, before anything is started.
        """
        argv = tuple(argv)
        if not argv:
            raise ValueError("start needs a command")
        env = dict(env or {})
        for key, value in env.items():
            if not _ENV_NAME_RE.match(key):
                raise ValueError(f"bad environment variable name {key!r}")
            if "\n" in value or "\0" in value:
                raise ValueError(f"environment variable {key} contains a newline or NUL")
        grace = str(max(1, round(grace_s * 10)))
        command = shlex.join(["sh", "-c", _WRAPPER, "ffctl-remote", grace, cwd or "", *argv])
        chan = self._session(timeout)
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            chan.sendall("".join(f"{k}={v}\n" for k, v in env.items()).encode() + b"\n")
            chan.settimeout(None)  # reads happen in the background with their own waits
        except (paramiko.SSHException, EOFError, OSError) as exc:
            chan.close()
            raise HostUnreachable(self.settings.label, f"cannot start `{shlex.join(argv)}`: {exc}") from None
        process = RemoteProcess(self.host, argv, chan)
        # Wait for the wrapper's marker so that a missing command or a bad cwd is an exception
        # here, not a process that is already dead when the caller first looks.
        if process._wait_started(timeout):
            return process
        status = process.wait(1.0)
        why = [line.text for line in process.iter_lines(0.2) if line.stream is Stream.STDERR]
        process.close()
        if status == 127:
            missing = why[-1].split(":")[0] if why else argv[0]
            raise RemoteCommandMissing(self.host, missing)
        if status is None:
            raise SSHError(self.host, f"`{shlex.join(argv)}` did not start within {timeout:g}s")
        detail = why[-1] if why else f"exit status {status}"
        raise SSHError(self.host, f"cannot start `{shlex.join(argv)}`: {detail}")

    def _sftp(self, timeout: float) -> paramiko.SFTPClient:
        chan = self._session(timeout)
        try:
            chan.settimeout(timeout)
            chan.invoke_subsystem("sftp")
            sftp = paramiko.SFTPClient(chan)
        except (paramiko.SSHException, EOFError, OSError) as exc:
            chan.close()
            raise SSHError(self.host, f"SFTP is not available: {exc}") from None
        return sftp

    def get_file(self, remote: str, local: str | Path, *, timeout: float = 60.0) -> None:
        """Copy a remote file here over SFTP (per-host logs, for instance)."""
        self._copy(lambda sftp: sftp.get(remote, str(local)), f"copying {remote}", f"cannot copy {remote}", timeout)

    def put_file(self, local: str | Path, remote: str, *, timeout: float = 60.0) -> None:
        """Copy a local file to the host over SFTP."""
        self._copy(lambda sftp: sftp.put(str(local), remote), f"copying to {remote}",
                   f"cannot copy {local} to {remote}", timeout)

    def _copy(self, action: Callable[[Any], Any], doing: str, failed: str, timeout: float) -> None:
        with self._sftp(timeout) as sftp:
            try:
                action(sftp)
            except (socket.timeout, TimeoutError):
                raise SSHError(self.host, f"{doing} timed out after {timeout:g}s") from None
            except OSError as exc:
                raise SSHError(self.host, f"{failed}: {exc.strerror or exc}") from None
