"""The Slurm node backend: inside an allocation, one agent per node as its own job step.

`ffctl launch --backend slurm` runs in the batch step of an `sbatch` job (or under `salloc`). The
allocation's nodes come from ``scontrol show hostnames $SLURM_JOB_NODELIST`` (or, on a host
without the Slurm client, from `expand_nodelist`, a parser of the node-list syntax): the first
``--nnodes`` of them run the job's nodes, the rest are held as spare nodes. Node N's agent is one
step, ``srun --jobid J --nodes 1 --ntasks 1 --nodelist HOST --overlap --kill-on-bad-exit ...
python -m ffctl.agent``; its `AgentConfig` (job token included) is the first line of the step's
stdin, which srun forwards to the task, never a command line or the step's environment. The
step's stdin stays open for the agent's lifetime: when the controller stops it, is interrupted or
dies, srun's stdin closes, the agent sees it and shuts its workers down, and the step ends.

A node fault on a Slurm node is the Slurm way: `kill-node` cancels the node's agent step
(``scancel --signal=KILL J.S``; scancel may print an error for a step yet kill it, so the step's
end is what is checked), Slurm kills every process of the step, and the controller starts the
node again on a spare node of the allocation while one is left (the record's ``slurm`` field
names which Slurm node runs which node, each time it changes). Every other fault's command runs
on its node as a step of its own (``srun --overlap ... ARGV``). Every step the launch started
is cancelled when it ends, however it ends.

The run record, the agents' logs and the working directory must be on a filesystem every node
of the allocation mounts (as a Slurm job's submit directory usually is): agents write their logs
straight into the record. Nothing here is needed outside this module.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Sequence

from fault_injectors.node import DRAIN_REASON_PREFIX, is_node_drain, is_node_kill, resume_argv
from fault_injectors.plan import HostCommand
from fault_injectors.revert import SHM_SWEEP
from fault_injectors.transport import CommandResult, LocalTransport, Transport
from ffctl.agent.config import AgentConfig
from ffctl.agent.config import agent_argv as agent_command
from ffctl.errors import EXIT_NO_REQUEUE, BadInput, InfraError, NoRequeue
from ffctl.spec import LaunchSpec
from runs.events import EventKind
from runs.shm import SHM_ROOT
from runs.store import RunStore

BACKEND = "slurm"
JOB_ID_ENV = "SLURM_JOB_ID"
NODELIST_ENV = "SLURM_JOB_NODELIST"
NODENAME_ENV = "SLURMD_NODENAME"  # the node a step (the batch step included) runs on
RESTART_ENV = "SLURM_RESTART_COUNT"  # how often the job was requeued
COMMAND_TIMEOUT_S = 30.0
# How long a cancelled step may take to end before the launch says it could not stop it.
STEP_END_S = 15.0
# How often the launch asks Slurm for its nodes' states (one sinfo call for all of them).
NODE_POLL_S = 2.0
# Node states (sinfo %T, flags stripped) that take a node out of a job's use.
OUT_STATES = ("down", "drain", "fail")

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


# --------------------------------------------------------------------------------------------
# the allocation's nodes


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets (``n[1-3,5],m7`` -> ``n[1-3,5]``, ``m7``)."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_range(body: str, whole: str) -> list[str]:
    """``1-3,05,7-8`` -> ``1 2 3 05 7 8``, keeping each range's zero padding as Slurm does."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in {whole!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards in {whole!r}")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(v).zfill(width) for v in range(int(lo), int(hi) + 1))
    return out


def _expand_one(item: str, whole: str) -> list[str]:
    """One host expression, each bracket group a range: ``r[1-2]n[1-2]`` is four hosts."""
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        if "[" in item or "]" in item:
            raise ValueError(f"unbalanced brackets in {whole!r}")
        return [item]
    head, tail = item[: m.start()], item[m.end():]
    return [f"{head}{v}{rest}" for v in _expand_range(m.group(1), whole) for rest in _expand_one(tail, whole)]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's node-list syntax as host names in order: ``n[1-3,5],m7`` -> n1 n2 n3 n5 m7.

    The fallback for hosts without ``scontrol``; raises ValueError on text it cannot read."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        for host in _expand_one(item, text):
            if host not in hosts:
                hosts.append(host)
    return hosts


def allocation(env: Mapping[str, str], run: Runner = subprocess.run) -> tuple[str, list[str]]:
    """(job id, the allocation's node names) from the Slurm environment; BadInput outside one."""
    job = env.get(JOB_ID_ENV, "").strip()
    nodelist = env.get(NODELIST_ENV, "").strip()
    if not job or not nodelist:
        raise BadInput("--backend slurm: not inside a Slurm allocation (no SLURM_JOB_ID and SLURM_JOB_NODELIST); "
                       "run it from an sbatch script or under salloc")
    try:
        out = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                  timeout=COMMAND_TIMEOUT_S, check=False)
        names = out.stdout.split() if out.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        names = []  # no Slurm client on this host: the node list read here
    if not names:
        try:
            names = expand_nodelist(nodelist)
        except ValueError as exc:
            raise BadInput(f"{NODELIST_ENV}={nodelist}: {exc}") from None
    if not names:
        raise BadInput(f"{NODELIST_ENV}={nodelist}: no nodes")
    return job, names


def split_nodes(spec: LaunchSpec, names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the job's nodes, the spare nodes): the first `spec.nnodes` names, and the rest."""
    if len(names) < spec.nnodes:
        raise BadInput(f"--nnodes {spec.nnodes}: the Slurm allocation has {len(names)} node(s) "
                       f"({', '.join(names)})")
    return list(names[: spec.nnodes]), list(names[spec.nnodes:])


def plan_hosts(spec: LaunchSpec, env: Mapping[str, str] | None = None) -> list[str]:
    """The Slurm nodes a launch would run its nodes on (the plan and `--dry-run` show them)."""
    _, names = allocation(os.environ if env is None else env)
    return split_nodes(spec, names)[0]


# --------------------------------------------------------------------------------------------
# requeues


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm requeued this job (``SLURM_RESTART_COUNT``; 0 when unset or unreadable)."""
    value = env.get(RESTART_ENV, "").strip()
    return int(value) if value.isdigit() else 0


def requeue_bound(spec: LaunchSpec) -> int:
    """The requeues a job may have: its --max-restarts, or the default the controller applies
    (torchrun's 0 for an unchanged script, 3 for the built-in GPT and the recovery library)."""
    if spec.max_restarts is not None:
        return spec.max_restarts
    from ffctl.spec import LIBRARY_MAX_RESTARTS, PLAIN_MAX_RESTARTS

    if spec.script:
        from ffctl.controller.controller import uses_recovery_library

        return LIBRARY_MAX_RESTARTS if uses_recovery_library(spec.script) else PLAIN_MAX_RESTARTS
    return LIBRARY_MAX_RESTARTS


def check_requeue(count: int, bound: int) -> None:
    """NoRequeue (exit 4) for a job requeued more often than `bound`: nothing starts."""
    if count > bound:
        raise NoRequeue(f"the Slurm job was requeued {count} time(s), more than --max-restarts {bound}: not "
                        f"starting (exit {EXIT_NO_REQUEUE}: do not requeue)")


def newest_checkpoint(runs_dir: Path, job: str, exclude: str = "") -> tuple[str, int, Path] | None:
    """(run id, step, step directory) of the newest complete disk checkpoint any earlier run of
    Slurm job `job` left in `runs_dir` (its run.json names the job); None when there is none."""
    from recovery.disk import complete_steps, step_dir  # torch comes with it: only when resuming

    best: tuple[str, int, Path] | None = None
    for info_path in sorted(runs_dir.glob("*/run.json")):
        run_dir = info_path.parent
        if run_dir.name == exclude:
            continue
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            continue
        slurm = info.get("slurm") if isinstance(info, dict) else None
        if not isinstance(slurm, dict) or str(slurm.get("job_id")) != job:
            continue
        steps = complete_steps(run_dir / "checkpoints")
        if steps and (best is None or steps[-1] > best[1]):
            best = (run_dir.name, steps[-1], step_dir(run_dir / "checkpoints", steps[-1]))
    return best


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # checkpoints are written once: a hard link costs no space
    except OSError:
        shutil.copy2(src, dst)


# --------------------------------------------------------------------------------------------
# commands


def step_argv(job: str, host: str, name: str, argv: Sequence[str]) -> list[str]:
    """`argv` as a one-task step of job `job` on `host`, sharing the allocation's resources with
    the batch step and the other steps (``--overlap``); a task that fails ends its step."""
    return ["srun", f"--jobid={job}", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap",
            "--kill-on-bad-exit=1", "--cpu-bind=none", f"--job-name={name}", "--quiet", *argv]


def agent_argv(job: str, host: str, name: str, python: str = sys.executable) -> list[str]:
    """The step that runs a node's agent (its config is the first line of the step's stdin)."""
    return step_argv(job, host, name, agent_command(python))


def cancel_argv(step: str, signal: str | None = None) -> list[str]:
    """``scancel [--signal=SIG] JOB.STEP``."""
    return ["scancel", *([f"--signal={signal}"] if signal else []), step]


def node_state(host: str, run: Runner = subprocess.run) -> str | None:
    """Slurm's state of `host` (``IDLE``, ``MIXED``, ``DOWN+DRAIN``...) with its reason if any;
    None when scontrol cannot say."""
    try:
        out = run(["scontrol", "show", "node", host, "--oneliner"], capture_output=True, text=True,
                  timeout=COMMAND_TIMEOUT_S, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = re.search(r"\bState=(\S+)", out)
    reason = re.search(r"\bReason=(.*?)(?: \w+=|$)", out)
    if state is None:
        return None
    return state.group(1) + (f" ({reason.group(1).strip()})" if reason and reason.group(1).strip() else "")


def sinfo_argv(hosts: Sequence[str]) -> list[str]:
    """One line per node: ``NAME|STATE|REASON`` (``sinfo --Node``)."""
    return ["sinfo", "--noheader", "--Node", f"--nodes={','.join(hosts)}", "--format=%N|%T|%E"]


def parse_node_states(text: str) -> dict[str, tuple[str, str]]:
    """``sinfo --Node --format=%N|%T|%E`` output as {node: (state, reason)}; a node listed once
    per partition counts once, lines it cannot read are skipped."""
    states: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        name, sep, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if sep and name and state:
            states.setdefault(name, (state.strip(), "" if reason.strip() == "none" else reason.strip()))
    return states


def is_out(state: str) -> bool:
    """Whether a node in `state` is out of use: DOWN, DRAIN(ED/ING), FAIL(ING), with or without
    sinfo's flag characters (``down*``, ``drained~``) or another state joined by '+'."""
    return any(word.strip("*~#%$@!^-").lower().startswith(OUT_STATES) for word in state.split("+"))


def ffctl_drained(states: Mapping[str, tuple[str, str]], run_id: str | None = None) -> list[str]:
    """The nodes ffctl drained (its reason mark), all runs' or one run's, still out of use."""
    mark = DRAIN_REASON_PREFIX + (f"{run_id}:" if run_id else "")
    return [n for n, (state, reason) in states.items() if is_out(state) and reason.startswith(mark)]


def node_address(host: str, run: Runner = subprocess.run) -> str:
    """The address Slurm reaches `host` on (its NodeAddr), as an IP address."""
    addr = host
    try:
        out = run(["scontrol", "show", "node", host, "--oneliner"], capture_output=True, text=True,
                  timeout=COMMAND_TIMEOUT_S, check=False)
        m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
        if m:
            addr = m.group(1)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0])
    except (OSError, IndexError):
        raise InfraError(f"Slurm node {host}: cannot resolve its address {addr!r}") from None


def _bindable(address: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def _route_source(destination: str, run: Runner = subprocess.run) -> str:
    """This host's source address on its route to `destination` (``ip route get``); "" if none."""
    try:
        words = run(["ip", "route", "get", destination], capture_output=True, text=True,
                    timeout=COMMAND_TIMEOUT_S, check=False).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return words[words.index("src") + 1] if "src" in words[:-1] else ""


def interface_of(address: str, ip_addr_output: str) -> str | None:
    """The interface `ip -o addr show` lists `address` on."""
    for line in ip_addr_output.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] in ("inet", "inet6") and words[3].split("/", 1)[0] == address:
            return words[1].rstrip(":").split("@", 1)[0]
    return None


# --------------------------------------------------------------------------------------------
# steps


class SlurmStep:
    """The controller's handle on one agent step: the local `srun` and the step it made."""

    pid = 0  # the agent's pid on its node is not known here (it reports it itself)

    def __init__(self, proc: subprocess.Popen[bytes], job: str, name: str, host: str, log: IO[bytes],
                 run: Runner = subprocess.run) -> None:
        self.proc = proc
        self.job = job
        self.name = name
        self.host = host
        self._log = log
        self._run = run
        self._step: str | None = None

    def poll(self) -> int | None:
        return self.proc.poll()

    def step_id(self, wait_s: float = 5.0) -> str | None:
        """``JOB.STEP`` of this step, found by its unique name in ``squeue --steps``."""
        deadline = time.monotonic() + wait_s
        while self._step is None:
            try:
                out = self._run(["squeue", "--steps", f"--jobs={self.job}", "--noheader", "--format=%i %j"],
                                capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
                for line in out.stdout.splitlines():
                    words = line.split()
                    if len(words) == 2 and words[1] == self.name:
                        self._step = words[0]
            except (OSError, subprocess.TimeoutExpired):
                pass
            if self._step is not None or time.monotonic() >= deadline or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        return self._step

    def cancel(self, signal: str = "KILL", timeout: float = STEP_END_S) -> bool:
        """Cancel the step (and with it every process of it) and wait for its end; True when it
        ended. scancel may print an error for a step it did kill, so the end is what counts."""
        step = self.step_id()
        if step is not None and self.proc.poll() is None:
            try:
                self._run(cancel_argv(step, signal), capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, check=False)
            except (OSError, subprocess.TimeoutExpired):
                pass
        elif self.proc.poll() is None:
            # Not (yet) known to squeue, e.g. still waiting for its resources: srun passes
            # SIGTERM on to the step's tasks, or gives the step up if it has none yet.
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout: float) -> None:
        """Close the agent's stdin (it stops its workers and exits), then cancel the step if it
        has not ended within `timeout`; idempotent."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if not self.cancel("KILL", timeout):
                self.proc.kill()  # srun itself; Slurm ends the step when the job does
                self.proc.wait(timeout=timeout)
        self._log.close()


class SlurmTransport:
    """A fault's command on a Slurm node: a one-task step of its own there."""

    def __init__(self, job: str, host: str, name: str) -> None:
        self.host = host
        self.job = job
        self.name = name

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        full = step_argv(self.job, self.host, self.name, argv)
        try:
            proc = subprocess.run(full, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError:
            return CommandResult(tuple(argv), 127, "", "srun: command not found")
        except subprocess.TimeoutExpired:
            return CommandResult(tuple(argv), 124, "", f"timed out after {timeout:g}s")
        return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        # A step's processes end with the step: the command is started as a step of its own that
        # lasts as long as the command (the job's end ends it too).
        subprocess.Popen(step_argv(self.job, self.host, self.name, argv), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


class StepKill:
    """kill-node on a Slurm node: its agent step cancelled with SIGKILL, which Slurm delivers to
    every process of the step (the agent, its ranks and spares)."""

    def __init__(self, step: SlurmStep) -> None:
        self.host = step.host
        self.step = step

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        ended = self.step.cancel("KILL", min(timeout, STEP_END_S))
        shown = tuple(cancel_argv(self.step.step_id(0.0) or f"{self.step.job}.?", "KILL"))
        return CommandResult(shown, 0 if ended else 1, "", "" if ended else "the step did not end")

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        raise OSError("a step cancel is not detached")


def doctor_transports(env: Mapping[str, str] | None = None) -> list[SlurmTransport]:
    """One transport per node of the allocation (spares included), for `ffctl doctor --backend
    slurm`: each check runs on its node as a step; BadInput outside an allocation."""
    job, names = allocation(os.environ if env is None else env)
    return [SlurmTransport(job, host, "ffctl-doctor") for host in names]


# --------------------------------------------------------------------------------------------
# the backend


@dataclass
class _Slot:
    """Which Slurm node runs a node now, and its step."""

    host: str
    step: SlurmStep | None = None


class SlurmNodes:
    """The node backend of `ffctl launch --backend slurm` (see the module docstring)."""

    run_dir: str | None = None  # the record is on a filesystem every node mounts

    def __init__(self, job: str, hosts: Sequence[str], spares: Sequence[str], run_id: str,
                 master_addr: str | None = None, run: Runner = subprocess.run,
                 popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen, restarts: int = 0) -> None:
        self.job = job
        self.restarts = restarts  # SLURM_RESTART_COUNT: a requeued job resumes an earlier run
        self.resumed_from: dict[str, Any] | None = None
        self.run_id = run_id
        self._slots = [_Slot(h) for h in hosts]
        self.spare_hosts = list(spares)
        self.failed_hosts: list[str] = []
        self.failed_states: dict[str, str | None] = {}
        self._master_addr = master_addr
        self._run = run
        self._popen = popen
        self._addresses: dict[str, str] = {}
        self._interfaces: dict[str, str] = {}
        self._steps: list[SlurmStep] = []  # every step started, to cancel at the end
        # Spare node -> its standby agent's step (started with the job's first agents, its
        # worker template warm long before a node needs it; see `ffctl.agent.agent.stand_by`).
        self._standby: dict[str, SlurmStep] = {}
        self._starts: dict[int, int] = {}
        self._lock = threading.Lock()
        self.log_dir: Path | None = None
        self._record: RunStore | None = None
        self.drained: dict[str, str] = {}  # host -> reason: nodes a fault drained, resumed at the end
        self.resumed: list[str] = []
        self.out_nodes: dict[str, str] = {}  # host -> Slurm's state and reason, when it took a node out
        self._left: dict[str, int] = {}  # host -> the node that left it for a spare node
        self._stop_poll = threading.Event()
        self._poller: threading.Thread | None = None

    @classmethod
    def for_launch(cls, spec: LaunchSpec, run_id: str, env: Mapping[str, str] | None = None) -> SlurmNodes:
        env = os.environ if env is None else env
        job, names = allocation(env)
        hosts, spares = split_nodes(spec, names)
        restarts = restart_count(env)
        if restarts:
            check_requeue(restarts, requeue_bound(spec))
        return cls(job, hosts, spares, run_id, spec.master_addr, restarts=restarts)

    # -- the launch's lifecycle -----------------------------------------------------------------
    def prepare(self) -> str:
        """Every node's address (and interface), and the address of this node the controller's
        store listens on: ``--master-addr``, else the address of the node this runs on."""
        for host in [s.host for s in self._slots] + self.spare_hosts:
            self._addresses[host] = node_address(host, self._run)
        for host in [s.host for s in self._slots] + self.spare_hosts:
            self._interfaces[host] = self._probe_interface(host)
        if self._master_addr:
            return self._master_addr
        here = os.environ.get(NODENAME_ENV, "")
        candidates = [node_address(here, self._run)] if here else []
        # Under salloc the shell may be on a login node: our source address toward the first node.
        first = self._addresses[self._slots[0].host]
        candidates += [first] if ipaddress.ip_address(first).is_loopback else [_route_source(first, self._run)]
        for addr in candidates:
            if addr and _bindable(addr):
                return addr
        raise InfraError(f"cannot tell which address of this host ({here or socket.gethostname()}) the Slurm "
                         "nodes reach; give --master-addr")

    def _probe_interface(self, host: str) -> str:
        addr = self._addresses[host]
        if ipaddress.ip_address(addr).is_loopback:
            return "lo"
        out = SlurmTransport(self.job, host, f"ffctl-{self.run_id}-probe").run(["ip", "-o", "addr", "show"],
                                                                             timeout=COMMAND_TIMEOUT_S)
        iface = interface_of(addr, out.stdout) if out.ok else None
        if iface is None:
            raise InfraError(f"Slurm node {host}: cannot tell the interface of its address {addr} "
                             f"({out.describe()})")
        return iface

    def attach(self, record: RunStore) -> None:
        self.log_dir = record.path / "logs"
        self._record = record
        if self.restarts:
            self._resume(record)
        self._note()
        self._poller = threading.Thread(target=self._poll_nodes, name="ffctl-slurm-nodes", daemon=True)
        self._poller.start()

    def _resume(self, record: RunStore) -> None:
        """A requeued job: the newest complete disk checkpoint an earlier run of this job left
        goes into this run's record, where the controller finds it and generation 0 restores it
        (none: the job starts over from step 0)."""
        found = newest_checkpoint(record.path.parent, self.job, record.run_id)
        if found is None:
            self.resumed_from = {"run": None, "step": 0}
            return
        run, step, src = found
        shutil.copytree(src, record.path / "checkpoints" / src.name, copy_function=_link_or_copy)
        self.resumed_from = {"run": run, "step": step}

    # -- what Slurm says of the nodes -----------------------------------------------------------
    def _poll_nodes(self) -> None:
        while not self._stop_poll.wait(NODE_POLL_S):
            hosts = [s.host for s in self._slots] + self.spare_hosts + self.failed_hosts
            try:
                out = self._run(sinfo_argv(hosts), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                                check=False)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out.returncode == 0:
                self.check_nodes(parse_node_states(out.stdout))

    def check_nodes(self, states: Mapping[str, tuple[str, str]]) -> None:
        """A node Slurm took out (DOWN, DRAIN, FAIL) while this run used it is a node fault: it
        is recorded (``node_state``), a spare node out of use is dropped, and a job node whose
        agent still runs there (a drain leaves steps running) has its step ended, so that the
        node comes back on a spare node. A node's host it already left (Slurm's DOWN ended its
        step, and the node moved before this poll) is recorded for that node. Nodes a fault of
        ours drained are not news."""
        for host, (state, reason) in states.items():
            if not is_out(state) or host in self.out_nodes or reason.startswith(DRAIN_REASON_PREFIX):
                continue
            with self._lock:
                node = next((i for i, s in enumerate(self._slots) if s.host == host), None)
                if node is None and host not in self.spare_hosts and host not in self._left:
                    continue  # not one of this run's
                self.out_nodes[host] = f"{state} ({reason})" if reason else state
                if host in self.spare_hosts:
                    self.spare_hosts.remove(host)
                standby = self._standby.pop(host, None) if node is None else None
                step = self._slots[node].step if node is not None else None
                node = self._left.get(host) if node is None else node
            if self._record is not None:
                self._record.append(EventKind.NODE_STATE, node=node, host=host, state=state, reason=reason,
                                    by="scheduler")
            if standby is not None:
                standby.stop(STEP_END_S)
            if step is not None and step.poll() is None and self.spare_hosts:
                step.cancel("KILL", STEP_END_S)
            # run.json is not written from this thread (its updates are read-modify-write): the
            # next start and the end write `out_of_use`.

    def release(self, record: RunStore | None) -> None:
        """Cancel every step this launch started that has not ended (the controller stopped the
        agents already when it could; a standby agent never needed is told by its stdin), and
        resume the nodes a fault drained."""
        self._stop_poll.set()
        if self._poller is not None:
            self._poller.join(timeout=COMMAND_TIMEOUT_S)
        for host in list(self.drained):
            try:
                done = self._run(resume_argv(host), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                                 check=False).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                done = False  # `ffctl inject revert --all` finds it by its reason
            if done:
                self.resumed.append(host)
        for step in self._standby.values():
            step.stop(STEP_END_S)
        for step in self._steps:
            if step.poll() is None:
                step.cancel("KILL", STEP_END_S)
        if record is not None:
            self._note()

    def _note(self) -> None:
        """The record's ``slurm`` field: the job, which Slurm node runs which node, spares left."""
        if self._record is None:
            return
        self._record.update_run_info(slurm={
            "job_id": self.job, "nodes": [s.host for s in self._slots], "spare_nodes": list(self.spare_hosts),
            "failed_nodes": list(self.failed_hosts), "failed_node_states": dict(self.failed_states),
            "out_of_use": dict(self.out_nodes), "drained": dict(self.drained), "resumed": list(self.resumed),
            "restart_count": self.restarts, **({"resumed_from": self.resumed_from} if self.resumed_from else {}),
            "addresses": {h: [a, self._interfaces.get(h)] for h, a in self._addresses.items()},
            # A step's JOB.STEP id is looked up when it is cancelled (a kill-node, the end).
            "steps": [{"name": s.name, "host": s.host, **({"step": s._step} if s._step else {})} for s in self._steps],
        })

    # -- NodeBackend ----------------------------------------------------------------------------
    def host(self, node: int) -> str:
        return self._slots[node].host

    def address(self, node: int) -> str:
        return self._addresses.get(self.host(node), "127.0.0.1")

    def interface(self, node: int) -> str | None:
        return self._interfaces.get(self.host(node))

    def netns(self, node: int) -> str | None:
        return None

    def has_gpu(self) -> bool:
        return False  # the nodes' devices are not probed: GPU faults run emulated

    def clock_offset(self, node: int) -> float | None:
        return None  # the agents' own reports say it

    def spare_nodes(self) -> int:
        return len(self.spare_hosts)

    def _placed(self, cfg: AgentConfig, host: str) -> AgentConfig:
        """`cfg` for an agent on `host`: it listens where that node is (its address and interface)."""
        iface = self._interfaces.get(host) or "lo"
        if cfg.address == self._addresses.get(host, "127.0.0.1") and cfg.worker_env.get("GLOO_SOCKET_IFNAME") == iface:
            return cfg
        return replace(cfg, address=self._addresses.get(host, "127.0.0.1"),
                       worker_env={**cfg.worker_env, "GLOO_SOCKET_IFNAME": iface})

    def _launch(self, cfg: AgentConfig, host: str, name: str, log_name: str) -> SlurmStep:
        """An agent step on `host`, `cfg` its stdin's first line."""
        assert self.log_dir is not None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / log_name, "ab")
        try:
            proc = self._popen(agent_argv(self.job, host, name, cfg.python), stdin=subprocess.PIPE,
                               stdout=log, stderr=log, cwd=cfg.cwd or None,
                               # Own session: a Ctrl-C reaches the controller only, which stops
                               # the agents in order (srun would cancel its step on it).
                               start_new_session=True)
            assert proc.stdin is not None
            proc.stdin.write((cfg.to_json() + "\n").encode())
            proc.stdin.flush()
        except OSError as exc:
            log.close()
            raise InfraError(f"cannot start node {cfg.node}'s agent on Slurm node {host}: {exc}") from None
        step = SlurmStep(proc, self.job, name, host, log, self._run)
        self._steps.append(step)
        return step

    def _stand_by(self, cfg: AgentConfig) -> None:
        """A standby agent on every spare node, from the first node's config: its worker
        template warms up beside the job's own, so a node that moves there later forks its
        ranks at once instead of waiting for torch to import."""
        for host in self.spare_hosts:
            if host not in self._standby:
                standby = replace(self._placed(cfg, host), standby=True,
                                  log_dir=str(self.log_dir / f"spare-{host}") if self.log_dir else cfg.log_dir)
                try:
                    self._standby[host] = self._launch(standby, host, f"ffctl-{self.run_id}-spare-{host}",
                                                       f"agent-spare-{host}.log")
                except InfraError:
                    pass  # a node moving there starts its agent the slow way

    def _adopt(self, cfg: AgentConfig, host: str) -> SlurmStep | None:
        """The standby agent of spare node `host`, given node `cfg.node`'s config; None when it
        is gone (its step ended) and a fresh step must start."""
        step = self._standby.pop(host, None)
        if step is None or step.poll() is not None or step.proc.stdin is None:
            return None
        try:
            step.proc.stdin.write((cfg.to_json() + "\n").encode())
            step.proc.stdin.flush()
        except OSError:
            return None
        return step

    def start(self, cfg: AgentConfig) -> SlurmStep:
        """Node `cfg.node`'s agent as a step. A node whose earlier step was ended (a node fault)
        moves to a spare node while the allocation has one, and its standby agent takes the node."""
        if self.log_dir is None:
            raise RuntimeError("SlurmNodes.start before attach(): no log directory")
        slot = self._slots[cfg.node]
        moved = False
        with self._lock:
            if slot.step is not None and slot.step.poll() is not None and self.spare_hosts:
                self.failed_hosts.append(slot.host)
                # What Slurm says of the node its step ended on (DOWN, DRAIN... or IDLE after a
                # step cancel), for the record.
                self.failed_states[slot.host] = node_state(slot.host, self._run)
                self._left[slot.host] = cfg.node
                slot.host = self.spare_hosts.pop(0)
                moved = True
            n = self._starts[cfg.node] = self._starts.get(cfg.node, 0) + 1
        # Where the agent listens is where its node is now (a spare node has its own address).
        cfg = self._placed(cfg, slot.host)
        step = self._adopt(cfg, slot.host) if moved else None
        if step is None:
            step = self._launch(cfg, slot.host, f"ffctl-{self.run_id}-node{cfg.node}-{n}", f"agent-{cfg.node}.log")
        slot.step = step
        if cfg.template:
            self._stand_by(cfg)
        self._note()
        return step

    # -- faults ---------------------------------------------------------------------------------
    def transport_for(self, cmd: HostCommand) -> Transport:
        """A kill-node cancels the node's agent step; any other command runs on its Slurm node as
        a step of its own; a host that is not one of the allocation's is this machine."""
        hosts = {s.host for s in self._slots} | set(self.spare_hosts) | set(self.failed_hosts)
        if is_node_drain(cmd) and cmd.host in hosts:
            # scontrol runs here (the batch step); the launch's end resumes the node.
            self.drained[cmd.host] = cmd.argv[-1].partition("=")[2]
            self._note()
            return LocalTransport(cmd.host, None)
        if cmd.host not in hosts:
            return LocalTransport(cmd.host, cmd.netns)
        if 0 <= cmd.node < len(self._slots):
            slot = self._slots[cmd.node]
            if is_node_kill(cmd) and slot.host == cmd.host and slot.step is not None:
                return StepKill(slot.step)
        return SlurmTransport(self.job, cmd.host, f"ffctl-{self.run_id}-fault")

    def sweep(self, run_id: str, nodes: Sequence[int]) -> None:
        """The run's shared memory no live process holds, removed on every node it used (an
        agent killed with its step could not remove its own)."""
        for host in dict.fromkeys([s.host for s in self._slots] + self.failed_hosts):
            SlurmTransport(self.job, host, f"ffctl-{run_id}-sweep").run(
                ["sh", "-c", SHM_SWEEP, "sh", SHM_ROOT, run_id], timeout=COMMAND_TIMEOUT_S)

    def describe(self) -> dict[str, Any]:
        return {"slurm": {"job_id": self.job, "nodes": [s.host for s in self._slots],
                          "spare_nodes": list(self.spare_hosts), "failed_nodes": list(self.failed_hosts),
                          "addresses": {h: [a, self._interfaces.get(h)] for h, a in self._addresses.items()}}}

