"""The local backend's handle on the host template, and on the node agents it forks.

`HostTemplate` starts `python -m ffctl.agent.host_template` (a warm process with torch imported,
see that module) once per launch and asks it for node agents; a `ForkedAgent` is the backend's
handle on one of them, the twin of `LocalAgent`: its pid, whether it still runs (the template
reports each exit, the agents being its children), and `stop` (EOF on the agent's stdin, which
the template holds; then SIGKILL after the deadline). A template that does not come up, or
dies, only means agents are started the ordinary way: `start_agent` returns None.

A reader thread takes the template's replies off its stdout as they come; what it cannot read
is written to the template's log and dropped, never fatal to the controller.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from ffctl.backends.children import running, stop_process
from wire import host_template as wire

READY_TIMEOUT_S = 120.0  # a torch import on a loaded host; the agents' own start waits as long
START_TIMEOUT_S = 30.0


def host_template_argv(python: str) -> list[str]:
    return [python, "-m", "ffctl.agent.host_template"]


class HostTemplate:
    """One host template for the launch: started by `start`, ended by `close`. Thread-safe."""

    def __init__(self, python: str, env: dict[str, str], cwd: str | None, log: Path) -> None:
        self.python, self.env, self.cwd, self.log_path = python, env, cwd, log
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._cond = threading.Condition()
        self._ready = False
        self._gone = False
        self._started: dict[int, wire.AgentStarted] = {}
        self._exits: dict[int, int] = {}
        self._req = 0

    def start(self) -> None:
        """Start it; it warms up in the background. One that cannot start is `gone`."""
        self._log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                host_template_argv(self.python), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self._log, env=self.env, cwd=self.cwd or None,
                # Its own session, as the agents it forks have: a Ctrl-C reaches the controller only.
                start_new_session=True,
            )
        except OSError as exc:
            self._note(f"host template: not started: {exc}")
            with self._cond:
                self._gone = True
            return
        threading.Thread(target=self._read, args=(self.proc.stdout,), name="ffctl-host-template", daemon=True).start()

    def _read(self, out: IO[bytes]) -> None:
        try:
            for line in out:
                try:
                    msg = wire.decode(line.rstrip(b"\n"))
                except wire.DecodeError as exc:
                    self._note(f"host template: unreadable reply: {exc}")
                    continue
                with self._cond:
                    if isinstance(msg, wire.Ready):
                        self._ready = True
                    elif isinstance(msg, wire.AgentStarted):
                        self._started[msg.id] = msg
                    elif isinstance(msg, wire.AgentExited):
                        self._exits[msg.pid] = msg.code
                    else:
                        self._note(f"host template: {type(msg).__name__} is not a reply")
                    self._cond.notify_all()
        except (OSError, ValueError):
            pass
        finally:
            with self._cond:
                self._gone = True
                self._cond.notify_all()

    def _note(self, line: str) -> None:
        if self._log is not None:
            try:
                self._log.write((line + "\n").encode())
                self._log.flush()
            except (OSError, ValueError):
                pass

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._ready or self._gone, timeout) and self._ready and not self._gone

    def _send(self, msg: wire.Message) -> bool:
        proc = self.proc
        if proc is None or proc.stdin is None:
            return False
        try:
            proc.stdin.write(wire.encode(msg))
            proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def start_agent(self, env: dict[str, str], cwd: str, log: Path, config: str,
                    timeout: float = START_TIMEOUT_S) -> ForkedAgent | None:
        """A node agent forked from the template; None when it cannot give one (not up, gone,
        or it could not fork), and the caller starts the agent itself."""
        if not self.wait_ready():
            return None
        with self._cond:
            self._req += 1
            req = self._req
        if not self._send(wire.StartAgent(req, env, cwd, str(log), config)):
            return None
        with self._cond:
            self._cond.wait_for(lambda: req in self._started or self._gone, timeout)
            reply = self._started.pop(req, None)
        if reply is None or not reply.pid:
            if reply is not None:
                self._note(f"host template: agent not started: {reply.error}")
            return None
        return ForkedAgent(self, reply.pid)

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            if self._gone:
                # Its exits are no longer reported: an agent alive is re-parented, and still a process.
                try:
                    os.kill(pid, 0)
                    return None
                except ProcessLookupError:
                    return -signal.SIGKILL
                except PermissionError:
                    return None
            return None

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while (code := self.exit_code(pid)) is None and time.monotonic() < deadline:
            with self._cond:
                self._cond.wait(min(0.2, max(0.0, deadline - time.monotonic())))
        return code

    def stop_agent(self, pid: int) -> None:
        self._send(wire.StopAgent(pid))

    def close(self, timeout: float = 5.0) -> None:
        """End the template as every local child ends (`stop_process`: EOF on its stdin, then
        SIGKILL after `timeout`). Agents it forked that still run get EOF on theirs as it exits,
        and stop."""
        proc, self.proc = self.proc, None
        log, self._log = self._log, None
        if proc is not None:
            stop_process(proc, timeout, log=log)
        elif log is not None:
            log.close()


class ForkedAgent:
    """The controller's handle on an agent the host template forked: what `LocalAgent` offers."""

    def __init__(self, template: HostTemplate, pid: int) -> None:
        self.template = template
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.template.exit_code(self.pid)
        return self.returncode

    def running_here(self) -> bool:
        # The host template serves only nodes without a network namespace of their own.
        return self.poll() is None and running(self.pid)

    def stop(self, timeout: float) -> None:
        """EOF on its stdin, as `stop_process` gives an agent it started; SIGKILL after `timeout`."""
        if self.poll() is not None:
            return
        self.template.stop_agent(self.pid)
        if self.template.wait_exit(self.pid, timeout) is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.template.wait_exit(self.pid, timeout)
        self.poll()
