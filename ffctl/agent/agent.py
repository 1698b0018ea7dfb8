"""The node agent (`ffctl agent`): one per node, started by the controller.

It spawns the node's ranks (from warm spares when it has them) with torchrun's environment,
sees a rank exit within one poll period (20 ms), heartbeats to the controller (from a thread of
its own, so that no command holds the beats up), holds the node's snapshot store (shared-memory
slots of its ranks, replicas of its ring neighbour's slots) and streams its slots to the
neighbour. It outlives every worker and takes them all down with it:
on `stop`, on SIGTERM, when its stdin closes (the controller or the SSH session is gone) or when
the controller's store stops answering. Shutdown is SIGTERM, a deadline, then SIGKILL.

This module is the agent's process: its entry point and its loop, which wires the pieces
together and runs each in turn. The pieces: the reporter (`ffctl.agent.reporter`) and the
heartbeat (`ffctl.agent.heartbeat`) towards the controller, the command handler
(`ffctl.agent.commands`), the node's snapshot store (`ffctl.agent.snapshots`), the worker
supervisor (`ffctl.agent.workers`) with its spare pool (`ffctl.agent.sparepool`), worker template
(`ffctl.agent.template`) and step watch (`ffctl.agent.stepwatch`).

The job token comes in the agent's own configuration (stdin, or the SSH session's environment),
never through the store. Every command on its queue must be sealed by the controller and decode
as one of `wire.messages`' commands; anything else is dropped and reported to the controller
as a sealed `rejected` message, and a command that fails is reported as an `agent_error`.
Ranks get the token in their assignment, over the pipe it comes on, and hold it in the
library only (`wire.jobenv.hand_token`): no worker's environment variable holds it.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from ffctl.agent import diagnostics
from ffctl.agent.commands import CommandHandler
from ffctl.agent.config import CONFIG_ENV, AgentConfig
from ffctl.agent.heartbeat import Heartbeat
from ffctl.agent.reporter import Reporter
from ffctl.agent.silence import OutputWatch
from ffctl.agent.snapshots import NodeSnapshots
from ffctl.agent.sparepool import SparePool
from ffctl.agent.stepscan import compile_step_regex
from ffctl.agent.stepwatch import StepWatch
from ffctl.agent.template import Template, set_child_subreaper
from ffctl.agent.workerenv import worker_env
from ffctl.agent.workers import WorkerSupervisor
from wire import control, messages, storeclient
from recovery.slots import NodeBusy
from runs import shm

log = logging.getLogger(__name__)

POLL_S = 0.02
HEARTBEAT_S = 0.2
STORE_GRACE_S = 5.0
# The agent is not told the world size; rank fields of commands are only bounded by this.
MAX_RANKS = 1 << 20


class Agent:
    watch_stdin = True  # False when stdin is not the controller's (see main)

    def __init__(self, cfg: AgentConfig, template: Template | None = None) -> None:
        if not cfg.shm_dir:
            cfg = replace(cfg, shm_dir=shm.new_run_dir(cfg.run_id))
        self.cfg = cfg
        # Forked workers are re-parented to us (see ffctl.agent.template): without the
        # subreaper role we could not watch them as our children, so fall back to cold starts.
        # A template given was warmed while this node's host was a spare node. Started first:
        # an agent forked from the host template (ffctl.agent.host_template) forks its worker
        # template from itself, which it may do only while it has one thread and nothing open.
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        if template is None and cfg.template and set_child_subreaper():
            template = Template(cfg.python, self._worker_base_env(), cfg.cwd, Path(cfg.log_dir) / "template.log")
            template.start()
        self.template = template
        # torch's store protocol in plain Python: the agent's own code never imports torch (it
        # starts in a tenth of the time, which a node fault's recovery waits for).
        self.store = storeclient.connect(cfg.store_host, cfg.store_port, timeout=10.0)
        sealer = control.Sealer(cfg.token, f"agent/{cfg.node}")
        self.reporter = Reporter(self.store, sealer, cfg.node, cfg.incarnation)
        self.inbox = control.Receiver(self.store, control.agent_queue(cfg.node, cfg.incarnation),
                                      opener=control.Opener(cfg.token), on_reject=self.reporter.rejected)
        self.heartbeat = Heartbeat(self.store, sealer, cfg.node, cfg.incarnation, self.reporter)
        self.stopping = threading.Event()
        self.snapshots = NodeSnapshots(cfg, self.reporter)  # claims the node, or raises
        self.spares = SparePool(cfg, template, self._worker_base_env, self.stopping, self.reporter.report)
        self.steps = StepWatch(compile_step_regex(cfg.step_regex), self.reporter.report) if cfg.step_regex else None
        self.workers = WorkerSupervisor(cfg, template, self.spares, self.steps, self._worker_base_env,
                                        self.stopping, self.reporter.report)
        self.output = OutputWatch(cfg.log_dir, self.reporter.report)
        self.commands = CommandHandler(self.inbox.queue, control.Limits(MAX_RANKS, cfg.nnodes), self.reporter,
                                       self.workers, self.snapshots, self.stopping, cfg.term_grace)

    def _worker_base_env(self) -> dict[str, str]:
        return worker_env(os.environ, self.cfg.worker_env, self.cfg.keep_freed_memory)

    def _watch_stdin(self) -> None:
        # The controller holds our stdin open; EOF means it (or its SSH session) is gone.
        # The descriptor itself, not sys.stdin's buffer: a thread blocked in the buffer holds its
        # lock, and at the interpreter's shutdown the main thread, taking that lock to close
        # stdin, aborted the agent ("could not acquire lock ... at interpreter shutdown").
        try:
            fd = sys.stdin.fileno()
            while os.read(fd, 4096):
                pass
        except (OSError, ValueError):
            pass
        self.stopping.set()

    def run(self) -> int:
        if self.watch_stdin:
            threading.Thread(target=self._watch_stdin, name="ffctl-stdin", daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        self.reporter.report(messages.AgentUp, pid=os.getpid(), host=socket.gethostname(), time=time.time(),
                             peer_address=self.snapshots.peer.address, peer_port=self.snapshots.peer.port)
        # The first beat before anything that can take a while (the snapshot server, spares,
        # the first commands): until it comes the controller can only guess we are starting.
        self.heartbeat.beat()
        self.loop_at = time.monotonic()
        self.heartbeat.start(HEARTBEAT_S, self.stopping, lambda: self.loop_at)
        self.snapshots.start()
        self.spares.top_up()
        # What this process holds now (torch, its imports, the agent's own objects) lives as
        # long as it does: out of the collector's sight, so that a full collection walks only
        # what came since, a few milliseconds, not a tenth of a second with every thread held.
        gc.freeze()
        last_ok = time.monotonic()
        try:
            while not self.stopping.is_set():
                self.loop_at = now = time.monotonic()
                try:
                    for msg in self.inbox.poll():
                        self.commands.handle(msg)
                    self.workers.spawn_held()
                    if self.steps is not None:
                        self.steps.poll()
                    self.snapshots.take_fault()
                    self.workers.reap()
                    self.output.poll(self.workers.live())
                    self.workers.tend_template()
                    self.workers.reap_orphans()
                    self.spares.top_up()
                    last_ok = now
                except Exception:
                    if time.monotonic() - last_ok > STORE_GRACE_S:
                        break  # the controller is gone: take everything down
                self.stopping.wait(POLL_S)
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        self.snapshots.stop_replicating()
        if self.template is not None:
            self.template.stop()
        self.spares.close()
        self.workers.stop_all(self.cfg.term_grace)
        self.snapshots.close()


def stand_by(cfg: AgentConfig) -> tuple[AgentConfig | None, Template | None]:
    """A spare node's agent, started before any node needs it: its worker template imports
    torch now, so that a node moving here forks its ranks at once. Waits for the node's own
    config (the next stdin line) and returns it with the template, which is kept only if it was
    started for the same workers; (None, None) when stdin closes first (never needed)."""
    template: Template | None = None
    if cfg.template and set_child_subreaper():
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        template = Template(cfg.python, worker_env(os.environ, cfg.worker_env, cfg.keep_freed_memory), cfg.cwd,
                            Path(cfg.log_dir) / "template.log")
        template.start()
    line = sys.stdin.readline()
    real = AgentConfig.from_json(line) if line.strip() else None
    if template is not None and (real is None or not real.template or (real.python, real.cwd) != (cfg.python, cfg.cwd)
                                 or worker_env(os.environ, real.worker_env, real.keep_freed_memory) != template.env):
        template.stop()
        template = None
    return real, template


def main() -> int:
    diagnostics.to_stderr()
    text = os.environ.pop(CONFIG_ENV, None)
    try:
        if text is not None:
            # Started over SSH: the remote wrapper gives us /dev/null for stdin and sends our
            # process group SIGTERM (then SIGKILL) when the channel closes, so stdin says nothing.
            # Popped, so the job token in it is not inherited by the workers' environment.
            agent = Agent(AgentConfig.from_json(text))
            agent.watch_stdin = False
        else:
            cfg: AgentConfig | None = AgentConfig.from_json(sys.stdin.readline())
            template = None
            if cfg is not None and cfg.standby:
                cfg, template = stand_by(cfg)
                if cfg is None:
                    return 0  # the run ended with this spare node unused
            assert cfg is not None
            agent = Agent(cfg, template)
    except (NodeBusy, shm.UnsafeShm) as exc:
        log.error("ffctl agent: %s", exc)
        return 2
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
