"""The host template: a warm process that forks the node agents of a launch on this machine.

Where every node of a launch runs on one machine (`--backend local`), a node that comes back
after a `kill-node` starts its agent, and that agent's worker template imports torch, on the
cores the training ranks use: seconds of CPU that a cluster would spend on the returning
machine's own cores, and that the one-machine run bills to the recovery as slower steps. The
local backend therefore starts this process once per launch: it imports torch, the recovery
library and the agent's runtime with the workers' environment (as a worker template does), then
forks each node's agent on request. A forked agent is warm: its worker template is forked from
it (`Template.start`) instead of importing torch again, so a returning node costs the ranks
milliseconds, and a launch of N nodes imports torch once instead of N times.

Protocol (`wire.host_template`): requests on stdin, replies on stdout. The template holds the
write end of each forked agent's stdin and writes the agent's config line into it, so an agent
started here behaves exactly like one the backend starts with `python -m ffctl.agent`: EOF on
its stdin (`StopAgent`, or this process gone, which the kernel makes EOF too) stops it in order.
Agents are this process's children: it reaps them and reports each exit (`AgentExited`).

Safety of fork: as the worker template, this process starts no thread (checked after the
warm-up), so each fork is a single-threaded copy. A forked agent sheds the template's pipes
(every descriptor above stderr is closed) and signal set-up before it runs.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import sys

from ffctl.agent import diagnostics
from ffctl.agent.template import Become, die_with_parent, enter_child, mark_warm, threads_now, warm_up, write_all
from wire import host_template as wire

log = logging.getLogger(__name__)


def _run_agent(msg: wire.StartAgent, stdin: int) -> int:
    """In the forked child: become a node agent as `python -m ffctl.agent` would start."""
    os.setsid()  # as the backend's Popen(start_new_session=True): a Ctrl-C reaches the controller only
    log_fd = os.open(msg.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    # Not the template's pipes, nor the other agents' stdins (which would never see EOF).
    enter_child((stdin, log_fd, log_fd), msg.env, msg.cwd)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # (fork cleared the death signal the template has: the agent stops on its stdin's EOF.)
    from ffctl.agent.agent import main

    return main()


def _fork_agent(msg: wire.StartAgent) -> tuple[int, int]:
    """Fork agent `msg`; (its pid, the write end of its stdin) in the template. In the child it
    raises `Become`: the agent runs from the top of the stack (`main`)."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        raise Become(lambda: _run_agent(msg, r))
    os.close(r)
    # The config line, as the backend writes it to an agent it starts itself. Small (no host
    # environment in it); the agent reads it first thing in any case.
    write_all(w, (msg.config.rstrip("\n") + "\n").encode())
    return pid, w


class _Server:
    def __init__(self) -> None:
        self.agents: set[int] = set()  # forked, not yet reaped
        self.stdins: dict[int, int] = {}  # forked agent -> the write end of its stdin, until stopped
        self.buf = b""

    def reply(self, msg: wire.Message) -> None:
        write_all(1, wire.encode(msg))

    def handle(self, line: bytes) -> None:
        try:
            msg = wire.decode(line)
        except wire.DecodeError as exc:
            log.error("host template: bad request: %s", exc)
            return
        if isinstance(msg, wire.StartAgent):
            try:
                pid, w = _fork_agent(msg)
            except OSError as exc:
                self.reply(wire.AgentStarted(msg.id, 0, f"fork failed: {exc}"))
                return
            self.agents.add(pid)
            self.stdins[pid] = w
            self.reply(wire.AgentStarted(msg.id, pid))
        elif isinstance(msg, wire.StopAgent):
            self._close(msg.pid)
        else:
            log.error("host template: %s is not a request", type(msg).__name__)

    def _close(self, pid: int) -> None:
        w = self.stdins.pop(pid, None)
        if w is not None:
            os.close(w)

    def reap(self) -> None:
        while self.agents:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.agents.discard(pid)
            self._close(pid)
            self.reply(wire.AgentExited(pid, os.waitstatus_to_exitcode(status)))

    def serve(self) -> None:
        """Until stdin closes: requests, and the exits SIGCHLD wakes us for."""
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up byte is written
        while True:
            self.reap()
            ready, _, _ = select.select([0, wake_r], [], [], 5.0)
            if wake_r in ready:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            if 0 in ready:
                chunk = os.read(0, 65536)
                if not chunk:
                    return
                self.buf += chunk
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    if line.strip():
                        self.handle(line)
                if len(self.buf) > wire.MAX_LINE:
                    log.error("host template: a request of over %d bytes dropped", wire.MAX_LINE)
                    self.buf = b""


def main() -> int:
    diagnostics.to_stderr()
    die_with_parent(os.getppid())
    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(0))
    started_with = dict(os.environ)  # before warm_up adds its own defaults
    warm_up()
    # What an agent runs, imported here once: a forked agent then imports nothing.
    import ffctl.agent.agent  # noqa: F401

    if threads_now() != 1:
        log.error("host template: %d threads after warm-up: refusing to fork", threads_now())
        return 3
    mark_warm(started_with, os.getcwd(), sys.executable)
    server = _Server()
    server.reply(wire.Ready(os.getpid()))
    try:
        server.serve()
        # Agents forked from here get EOF on their stdin as we exit: the write ends close with us.
        # Nothing of ours needs the interpreter's finalization, which with torch loaded takes
        # a second the launch's end would wait for.
        sys.stderr.flush()
        os._exit(0)
    except Become as child:
        target = child.target
    # A forked child (an agent; then, from the agent, its worker template; from that, a worker):
    # each runs here, with its parent's frames gone, and ends as the interpreter ends.
    while True:
        try:
            return target()
        except Become as child:
            target = child.target


if __name__ == "__main__":
    sys.exit(main())
