"""The node agent (`ffctl agent`): one per node, started by the controller.

It spawns the node's ranks (from warm spares when it has them) with torchrun's environment,
sees a rank exit within one poll period (20 ms), heartbeats to the controller, holds the node's
snapshot store (shared-memory slots of its ranks, replicas of its ring neighbour's slots) and
streams its slots to the neighbour. It outlives every worker and takes them all down with it:
on `stop`, on SIGTERM, when its stdin closes (the controller or the SSH session is gone) or when
the controller's store stops answering. Shutdown is SIGTERM, a deadline, then SIGKILL.

The job token comes in the agent's own configuration (stdin, or the SSH session's environment),
never through the store. Every command on its queue must be sealed by the controller and decode
as one of `recovery.messages`' commands; anything else is dropped and reported to the controller
as a sealed `rejected` message, and a command that fails is reported as an `agent_error`.
Ranks get the token in their assignment, over the pipe it comes on, and hold it in the
library only (`recovery.jobenv.hand_token`): no worker's environment variable holds it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import psutil

from recovery.replicator import Replicator
from ffctl.agent.config import CONFIG_ENV, AgentConfig
from ffctl.agent.stepscan import StepScanner, compile_step_regex
from ffctl.agent.template import (
    Assignment, ForkedSpare, ForkedWorker, Template, TemplateError, set_child_subreaper,
)
from ffctl.agent.workerenv import worker_env
from recovery import control, messages
from recovery.peer import PeerStore
from recovery.jobenv import ERROR_FILE_ENV
from recovery.slots import NodeBusy, claim_node, read_header, release_node, slot_path
from runs import shm

POLL_S = 0.02
HEARTBEAT_S = 0.2
STORE_GRACE_S = 5.0
SPARE_REFILL_DELAY_S = 5.0
# How long the job's first workers wait for the template's first warm-up before starting cold.
FIRST_WARMUP_WAIT_S = 30.0
STEP_SCAN_S = 0.1  # how often workers' logs are read for `--step-regex`
# What of a failed rank's log goes to the controller with its exit.
LOG_TAIL_LINES = 20
LOG_TAIL_BYTES = 16384
LOG_LINE_CHARS = 400
# How long a restarted node's agent waits for its predecessor on the same host to let go of the
# node's claim (see Agent.__init__).
CLAIM_WAIT_S = 10.0
# The agent is not told the world size; rank fields of commands are only bounded by this.
MAX_RANKS = 1 << 20


@dataclass
class Worker:
    rank: int
    gen: int
    proc: subprocess.Popen[bytes] | ForkedWorker | ForkedSpare
    expected_exit: bool = False
    report_tail: bool = False  # report the end of its log with its exit, even an expected one


def read_error_file(path: Path) -> str | None:
    """The error message in a torchelastic error file (`{"message": {"message": ...}}` as torch's
    `@record` writes it, or `{"message": "..."}`), bounded; None when there is none."""
    try:
        # Never blocks (a FIFO where the file goes is refused) and never raises: a worker's
        # script wrote it, and the agent reads it on its one loop.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = json.loads(fh.read(1 << 20).decode("utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    return (msg.strip()[:500] or None) if isinstance(msg, str) else None


def kill_tree(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM every process and its descendants, wait `grace`, SIGKILL what is left."""
    everyone: list[psutil.Process] = []
    for proc in procs:
        try:
            everyone += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for proc in everyone:
        try:
            proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(everyone, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


class Agent:
    watch_stdin = True  # False when stdin is not the controller's (see main)

    def __init__(self, cfg: AgentConfig, template: Template | None = None) -> None:
        if not cfg.shm_dir:
            cfg = replace(cfg, shm_dir=shm.new_run_dir(cfg.run_id))
        self.cfg = cfg
        self.store = control.connect(cfg.store_host, cfg.store_port, timeout=10.0)
        self.sealer = control.Sealer(cfg.token, f"agent/{cfg.node}")
        self.inbox = control.Receiver(self.store, control.agent_queue(cfg.node, cfg.incarnation),
                                      opener=control.Opener(cfg.token), on_reject=self._rejected)
        self.limits = control.Limits(MAX_RANKS, cfg.nnodes)
        self.beats = 0
        self._last_beat: bytes | None = None  # the sealed value of our last heartbeat
        self.workers: dict[int, Worker] = {}
        self.spares: list[subprocess.Popen[bytes] | ForkedSpare] = []
        self.warm: set[subprocess.Popen[bytes]] = set()
        self.reported_spares: tuple[int, int, bool] = (-1, -1, False)
        self.last_spawn = float("-inf")
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        # A node started again may find its previous agent on this host still shutting down (a
        # node Slurm marked down, whose processes live on until they see their stdin close): its
        # claim is released when it exits, so a restarted node waits a little for it.
        deadline = time.monotonic() + (CLAIM_WAIT_S if cfg.incarnation else 0.0)
        while True:
            try:
                self._claim = claim_node(cfg.shm_dir, cfg.run_id, cfg.node)
                break
            except NodeBusy as exc:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                self._report(messages.AgentFailed, reason=str(exc))
                raise
            except shm.UnsafeShm as exc:
                self._report(messages.AgentFailed, reason=str(exc))
                raise
        self._wipe_slots()  # a (re)started node is an empty node
        self.peer = PeerStore(cfg.address, cfg.token, self.slot, on_refused=self._peer_refused).start()
        self.replicator = Replicator(cfg.run_id, cfg.node, cfg.token, self._slot_files,
                                     self._report_kind)
        Path(cfg.log_dir).mkdir(parents=True, exist_ok=True)
        self.template: Template | None = None
        self._orphans_at = 0.0
        self.step_pattern = compile_step_regex(cfg.step_regex) if cfg.step_regex else None
        self.scanners: dict[int, tuple[int, StepScanner, float]] = {}  # rank -> (gen, scanner, last step at)
        self._scanned_at = 0.0
        # The FIFOs forked spares wait on: the node's (under its claim), owner-only, removed at
        # shutdown, or by the controller's sweep when the node was killed.
        self._fifos = shm.spare_dir(cfg.shm_dir, cfg.run_id, cfg.node)
        shutil.rmtree(self._fifos, ignore_errors=True)
        self._fifos.mkdir(mode=0o700)
        self._spare_n = 0
        # Spawn commands held until the template's first warm-up is over: (gen, ranks, received).
        self._held: list[tuple[int, list[dict[str, Any]], float]] = []
        # Forked workers are re-parented to us (see ffctl.agent.template): without the
        # subreaper role we could not watch them as our children, so fall back to cold starts.
        if template is not None:
            self.template = template  # warmed while this node's host was a spare node
        elif cfg.template and set_child_subreaper():
            self.template = Template(cfg.python, self._worker_base_env(), cfg.cwd,
                                     Path(cfg.log_dir) / "template.log")
            self.template.start()

    # -- slots --------------------------------------------------------------------------------
    def slot(self, rank: int, index: int) -> Path:
        return slot_path(self.cfg.shm_dir, self.cfg.run_id, self.cfg.node, rank, index)

    def _slot_files(self) -> list[Path]:
        return shm.node_slots(self.cfg.shm_dir, self.cfg.run_id, self.cfg.node)

    def _wipe_slots(self) -> None:
        for path in self._slot_files():
            path.unlink(missing_ok=True)

    def inventory(self) -> dict[str, Any]:
        local: dict[str, list[int]] = {}
        for path in self._slot_files():
            rank = shm.slot_rank(path, self.cfg.run_id, self.cfg.node)
            header = read_header(path)
            if header is not None and header.valid:
                local.setdefault(str(rank), []).append(header.step)
        return {"local": local, "replica": self.peer.inventory()["replica"]}

    # -- workers -------------------------------------------------------------------------------
    def _worker_base_env(self) -> dict[str, str]:
        return worker_env(os.environ, self.cfg.worker_env, self.cfg.keep_freed_memory)

    def _tend_template(self) -> None:
        """Restart a template that died; until it is warm again, workers start cold."""
        if self.template is not None and not self.template.alive() and not self.stopping.is_set():
            code = self.template.proc.returncode if self.template.proc is not None else None
            print(f"ffctl agent {self.cfg.node}: worker template exited ({code}); restarting it",
                  file=sys.stderr, flush=True)
            self.template.start()

    def _reap_orphans(self) -> None:
        """As the subreaper we inherit whatever a dead worker left (its own children): reap the
        ones that ended, so none stays a zombie. Not every poll: listing children reads /proc."""
        now = time.monotonic()
        if self.template is None or now - self._orphans_at < 1.0:
            return
        self._orphans_at = now
        known = {w.proc.pid for w in self.workers.values()} | {p.pid for p in self.spares}
        if self.template.proc is not None:
            known.add(self.template.proc.pid)
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for child in children:
            try:
                if child.pid not in known and child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                pass

    def _start_spare(self) -> subprocess.Popen[bytes]:
        log = open(Path(self.cfg.log_dir) / "spares.log", "ab")
        try:
            proc = subprocess.Popen(
                [self.cfg.python, "-m", "ffctl.agent.spare"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=log, cwd=self.cfg.cwd or None,
                env=self._worker_base_env(),
            )
        finally:
            log.close()
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        return proc

    def _fork_spare(self) -> ForkedSpare | None:
        assert self.template is not None
        self._spare_n += 1
        try:
            return self.template.fork_spare(self._worker_base_env(), self._fifos / f"spare-{self._spare_n}",
                                            str(Path(self.cfg.log_dir) / "spares.log"), self.cfg.cwd)
        except (TemplateError, OSError) as exc:
            print(f"ffctl agent {self.cfg.node}: forking a spare: {exc}", file=sys.stderr, flush=True)
            return None

    def _spare_ready(self, proc: subprocess.Popen[bytes] | ForkedSpare) -> bool:
        if isinstance(proc, ForkedSpare):
            return True  # warm from birth; `assign` finds out whether it listens yet
        if proc in self.warm:
            return True
        assert proc.stdout is not None
        try:
            if proc.stdout.read(6):
                self.warm.add(proc)
                return True
        except (BlockingIOError, OSError, ValueError):
            pass
        return False

    def _top_up_spares(self) -> None:
        self.spares = [p for p in self.spares if p.poll() is None]
        forking = self.template is not None and self.template.is_ready()
        # A spare forked from the template costs nothing to speak of: refill at once, so faults
        # close together never find the pool empty. A fresh one spends seconds of CPU importing
        # torch; right after a replacement that would slow the recovering job, so it waits.
        settling = time.monotonic() - self.last_spawn < SPARE_REFILL_DELAY_S
        # A template still warming up will fork the spares in a moment: no fresh ones meanwhile.
        warming = self.template is not None and self.template.alive() and not forking
        while not warming and len(self.spares) < self.cfg.spares and not self.stopping.is_set() and (forking or not settling):
            spare = self._fork_spare() if forking else self._start_spare()
            if spare is None:
                break
            self.spares.append(spare)
        ready = sum(1 for p in self.spares if self._spare_ready(p))
        # A warm template starts replacements as fast as a spare: the controller places the
        # ranks of a lost node where one is warm.
        template = self.template is not None and self.template.is_ready()
        if (ready, len(self.spares), template) != self.reported_spares:
            self.reported_spares = (ready, len(self.spares), template)
            self._report(messages.Spares, count=ready, total=len(self.spares), template=template)

    def _first_warmup(self) -> bool:
        """Whether the template is still on its first warm-up (started with the agent)."""
        return (self.template is not None and self.template.starts == 1 and self.template.alive()
                and not self.template.is_ready())

    def _spawn_held(self) -> None:
        """Start the held workers once the template is warm (or died, or took too long)."""
        if not self._held:
            return
        if self._first_warmup() and time.monotonic() - self._held[0][2] < FIRST_WARMUP_WAIT_S:
            return
        held, self._held = self._held, []
        for gen, ranks, received in held:
            if ranks:  # all of them may have been killed meanwhile
                self.spawn(gen, ranks, received)

    def spawn(self, gen: int, ranks: list[dict[str, Any]], received: float | None = None) -> None:
        if gen > 0:
            self.last_spawn = time.monotonic()
        pids: dict[str, int] = {}
        how: dict[str, str] = {}
        took: dict[str, float] = {}
        for spec in ranks:
            rank = int(spec["rank"])
            # How long the worker took to start counts from the command (a held one's wait too).
            t0 = time.monotonic() if received is None else received
            assignment = {
                "env": {**self.cfg.worker_env, **spec["env"],
                        ERROR_FILE_ENV: str(self._error_file(rank, gen)),
                        # Where the rank's slots and in-step faults are: known to this host's
                        # processes only, never sent through the store.
                        "FFCTL_SHM_DIR": self.cfg.shm_dir, "FFCTL_FAULT_DIR": self.cfg.shm_dir},
                "argv": list(self.cfg.worker_argv),
                "log": os.path.abspath(Path(self.cfg.log_dir) / f"{rank}.log"),
                "cwd": self.cfg.cwd,
                # The token goes to the rank here, over a private pipe (the spare's stdin or FIFO,
                # or the template's), never through the store, and the worker hands it to the
                # library without putting it in its environment (recovery.jobenv.hand_token).
                "token": self.cfg.token,
            }
            if self.step_pattern is not None:
                # The worker appends to its log: its steps are what it writes from here on.
                log = Path(assignment["log"])
                offset = log.stat().st_size if log.exists() else 0
                self.scanners[rank] = (gen, StepScanner(self.step_pattern, log, offset), time.monotonic())
            proc, how[str(rank)] = self._start_worker(assignment)
            took[str(rank)] = round(time.monotonic() - t0, 6)
            with self.lock:
                self.workers[rank] = Worker(rank, gen, proc)
            pids[str(rank)] = proc.pid
        self._report(messages.Spawned, gen=gen, pids=pids, how=how, start_s=took)

    def _start_worker(
        self, assignment: dict[str, Any],
    ) -> tuple[subprocess.Popen[bytes] | ForkedWorker | ForkedSpare, str]:
        """Start one worker: a warm spare if one is ready, else a fork of the template, else a
        fresh interpreter (the oldest spare still warming up, or a new one). Says which."""
        line = (json.dumps(assignment) + "\n").encode()
        for spare in [p for p in self.spares if isinstance(p, ForkedSpare)]:
            self.spares.remove(spare)
            if spare.assign(line):
                return spare, "spare"
            # Not listening (still starting, or gone): it is of no use to anyone.
            kill_tree([psutil.Process(spare.pid)] if psutil.pid_exists(spare.pid) else [], 0.5)
            spare.poll()
        ready = [p for p in self.spares if self._spare_ready(p)]
        if ready:
            proc = ready[0]
            how = "spare"
        else:
            if self.template is not None and self.template.is_ready():
                env = {**self._worker_base_env(), **assignment["env"]}
                job = Assignment(env, tuple(assignment["argv"]), assignment["log"], assignment["cwd"],
                                 assignment["token"])
                try:
                    return self.template.fork(job), "template"
                except TemplateError as exc:
                    print(f"ffctl agent {self.cfg.node}: {exc}; starting the worker cold",
                          file=sys.stderr, flush=True)
            proc = self.spares[0] if self.spares else self._start_spare()
            how = "cold"
        if proc in self.spares:
            self.spares.remove(proc)
        assert isinstance(proc, subprocess.Popen) and proc.stdin is not None
        proc.stdin.write(line)
        proc.stdin.close()
        return proc, how

    def kill(self, ranks: list[int], grace: float, tail: bool = False) -> None:
        with self.lock:
            targets = [self.workers[r] for r in ranks if r in self.workers]
            for w in targets:
                w.expected_exit = True
                w.report_tail = tail
        procs = []
        for w in targets:
            try:
                procs.append(psutil.Process(w.proc.pid))
            except psutil.NoSuchProcess:
                pass
        threading.Thread(target=kill_tree, args=(procs, grace), daemon=True).start()

    def _reap(self) -> None:
        with self.lock:
            for rank, w in list(self.workers.items()):
                code = w.proc.poll()
                if code is None:
                    continue
                del self.workers[rank]
                # The end of its log says why it failed; read here, so it reaches the controller
                # from any host. Exits asked for (a kill, the end of the run) need none.
                tail = self._log_tail(rank) if w.report_tail or not (w.expected_exit or code == 0) else []
                error = None if w.expected_exit or code == 0 else read_error_file(self._error_file(rank, w.gen))
                self._report(messages.RankExited, rank=rank, gen=w.gen, pid=w.proc.pid, exitcode=code,
                             expected=w.expected_exit, host=socket.gethostname(), log_tail=tail,
                             **({"error": error} if error else {}))

    def _error_file(self, rank: int, gen: int) -> Path:
        """Where torch's `@record` writes the rank's error (torchrun's TORCHELASTIC_ERROR_FILE):
        one file per rank and generation, beside its log."""
        # Absolute, as torchrun hands it out: a script that changes directory before it fails
        # still writes it where it is looked for.
        return Path(os.path.abspath(self.cfg.log_dir)) / f"{rank}.gen{gen}.error.json"

    def _log_tail(self, rank: int, lines: int = LOG_TAIL_LINES) -> list[str]:
        """The last `lines` lines of the rank's log (all of its generations write to it)."""
        try:
            with open(Path(self.cfg.log_dir) / f"{rank}.log", "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - LOG_TAIL_BYTES))
                data = fh.read(LOG_TAIL_BYTES)
        except OSError:
            return []
        text = data.decode("utf-8", errors="replace").splitlines()
        return [line[:LOG_LINE_CHARS] for line in text[-lines:]]

    def _scan_steps(self) -> None:
        """Report the steps the workers printed since the last look (`--step-regex`)."""
        now = time.monotonic()
        if not self.scanners or now - self._scanned_at < STEP_SCAN_S:
            return
        self._scanned_at = now
        for rank, (gen, scanner, last_at) in list(self.scanners.items()):
            seen = scanner.poll()
            if not seen:
                continue
            # The time since the previous step was seen, shared among the steps seen together.
            dt = (now - last_at) / len(seen)
            self.scanners[rank] = (gen, scanner, now)
            for found in seen:
                self._report(messages.Step, rank=rank, gen=gen, step=found.step, dt=dt, loss=found.loss)

    # -- control -------------------------------------------------------------------------------
    def _report(self, kind: type[messages.Message], **fields: Any) -> None:
        """Report a message of `kind` to the controller (every one from an agent names its node)."""
        msg = kind(node=self.cfg.node, **fields)  # type: ignore[call-arg]
        blocked = control.send(self.store, control.CTL_QUEUE, msg, self.sealer)
        if blocked is not None:
            # The controller's queue counter was tampered with and not repaired: the controller
            # is not reading it, so there is nobody to tell but our log.
            print(f"ffctl agent {self.cfg.node}: {msg.kind.value} not sent: {blocked.reason}: "
                  f"{control.short_repr(blocked.raw)}", file=sys.stderr, flush=True)

    def _beat(self) -> None:
        """Write a sealed heartbeat to our key. If our last one is no longer there, someone
        wrote over (or deleted) it, and may do so again before the controller reads the next:
        the controller is told, and this beat also goes by the queue, which nobody can write
        over."""
        key = control.heartbeat_key(self.cfg.node)
        if self._last_beat is not None:
            found = control.read(self.store, key)
            if found != self._last_beat:
                self._rejected(key, -1, "heartbeat key deleted" if found is None else
                               "heartbeat key written over by someone else", found or b"")
        else:
            found = None
        self.beats += 1
        beat = messages.Heartbeat(node=self.cfg.node, incarnation=self.cfg.incarnation, beat=self.beats)
        value = self.sealer.seal(key, beat.to_dict()).encode()
        self.store.set(key, value)
        if self._last_beat is not None and found != self._last_beat:
            self._report(messages.Heartbeat, incarnation=self.cfg.incarnation, beat=self.beats)
        self._last_beat = value

    def _report_kind(self, kind: str, **fields: Any) -> None:
        # The replicator names what it reports by its wire kind: it knows nothing of the agent.
        self._report(messages.report_type(kind), **fields)

    def _rejected(self, where: str, index: int, reason: str, raw: bytes) -> None:
        print(f"ffctl agent {self.cfg.node}: rejected {where}/{index}: {reason}: {control.short_repr(raw)}",
              file=sys.stderr, flush=True)
        try:
            self._report(messages.Refusal, where=where, index=index, reason=reason, raw=control.short_repr(raw))
        except Exception:  # noqa: BLE001 - the controller is gone; the log line stays
            pass

    def _peer_refused(self, why: str, unreported: int) -> None:
        # Called from the snapshot channel's connection threads; the store already logged it.
        self._report(messages.Refusal, where="snapshot channel", reason=why[:500],
                     **({"unreported": unreported} if unreported else {}))

    def handle(self, raw: dict[str, Any]) -> None:
        """Carry out one command read from our queue. One that does not decode or has no handler
        is reported as refused; one whose handler fails is reported as an `agent_error`: the
        controller hears of every command it sent that was not carried out."""
        try:
            cmd = messages.decode(raw, self.limits, command=True)
        except messages.DecodeError as exc:
            self._rejected(self.inbox.queue, -1, exc.reason, json.dumps(raw)[:200].encode())
            return
        handler = self.COMMAND_HANDLERS.get(cmd.kind)  # type: ignore[call-overload]
        if handler is None:
            self._rejected(self.inbox.queue, -1, f"no handler for command {cmd.kind.value!r}",
                           json.dumps(raw)[:200].encode())
            return
        try:
            handler(self, cmd)
        except Exception as exc:  # noqa: BLE001 - reported, and the agent goes on with the next
            error = f"{cmd.kind.value}: {type(exc).__name__}: {exc}"[:500]
            print(f"ffctl agent {self.cfg.node}: command failed: {error}", file=sys.stderr, flush=True)
            try:
                self._report(messages.AgentError, error=error)
            except Exception:  # noqa: BLE001 - the controller is gone; the log line stays
                pass

    def _on_spawn(self, cmd: messages.Spawn) -> None:
        if self._first_warmup():
            # The job's first workers, while the template imports torch: started cold now, each
            # would import torch beside it, and on a host with fewer cores than processes all of
            # them would take about twice as long as the template alone and a fork. Replacements
            # after a template died do not wait: they start cold at once (recorded as such).
            self._held.append((cmd.gen, list(cmd.ranks), time.monotonic()))
            return
        self.spawn(cmd.gen, cmd.ranks)

    def _on_kill(self, cmd: messages.Kill) -> None:
        # A held worker told to stop is never started.
        killed = {int(r) for r in cmd.ranks}
        for _, ranks, _ in self._held:
            ranks[:] = [spec for spec in ranks if int(spec["rank"]) not in killed]
        self.kill(list(cmd.ranks), self.cfg.term_grace if cmd.grace is None else float(cmd.grace), tail=bool(cmd.tail))

    def _on_neighbor(self, cmd: messages.Neighbor) -> None:
        self.replicator.set_target(cmd.address, cmd.port)

    def _on_inventory(self, cmd: messages.InventoryRequest) -> None:
        self._report(messages.Inventory, req=cmd.req, **self.inventory())

    def _on_stop(self, cmd: messages.Stop) -> None:
        self.stopping.set()

    # One handler per command kind (tests check that every kind has one).
    COMMAND_HANDLERS: dict[messages.CommandKind, Callable[[Agent, Any], None]] = {
        messages.CommandKind.SPAWN: _on_spawn,
        messages.CommandKind.KILL: _on_kill,
        messages.CommandKind.NEIGHBOR: _on_neighbor,
        messages.CommandKind.INVENTORY: _on_inventory,
        messages.CommandKind.STOP: _on_stop,
    }

    def _watch_stdin(self) -> None:
        # The controller holds our stdin open; EOF means it (or its SSH session) is gone.
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        self.stopping.set()

    def run(self) -> int:
        if self.watch_stdin:
            threading.Thread(target=self._watch_stdin, name="ffctl-stdin", daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        self._report(messages.AgentUp, pid=os.getpid(), host=socket.gethostname(), time=time.time(),
                     peer_address=self.peer.address, peer_port=self.peer.port)
        self.replicator.start()
        self._top_up_spares()
        last_beat, last_ok = 0.0, time.monotonic()
        try:
            while not self.stopping.is_set():
                try:
                    for msg in self.inbox.poll():
                        self.handle(msg)
                    self._spawn_held()
                    now = time.monotonic()
                    if now - last_beat >= HEARTBEAT_S:
                        self._beat()
                        last_beat = now
                    self._scan_steps()
                    self._reap()
                    self._tend_template()
                    self._reap_orphans()
                    self._top_up_spares()
                    last_ok = now
                except Exception:
                    if time.monotonic() - last_ok > STORE_GRACE_S:
                        break  # the controller is gone: take everything down
                self.stopping.wait(POLL_S)
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        self.replicator.stop()
        if self.template is not None:
            self.template.stop()
        shutil.rmtree(self._fifos, ignore_errors=True)
        procs = []
        for p in [w.proc for w in self.workers.values()] + self.spares:
            try:
                procs.append(psutil.Process(p.pid))
            except psutil.NoSuchProcess:
                pass
        kill_tree(procs, self.cfg.term_grace)
        for p in [w.proc for w in self.workers.values()] + self.spares:
            p.poll()
        try:
            self._reap()
        except Exception:
            pass
        self.peer.stop()
        self._wipe_slots()
        release_node(self.cfg.shm_dir, self.cfg.run_id, self.cfg.node, self._claim)
        # The host's last holder of the run's directory takes it away (over SSH there is nobody
        # else to; locally the launcher holds it until its own sweep).
        if not shm.in_use(self.cfg.shm_dir):
            shm.remove_run_dir(Path(self.cfg.shm_dir))


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
        print(f"ffctl agent: {exc}", file=sys.stderr)
        return 2
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
