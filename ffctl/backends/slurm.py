"""The Slurm node backend: inside an allocation, one agent per node as its own job step.

`SlurmNodes` implements `ffctl.backends.protocol.LaunchBackend`. `ffctl launch --backend slurm` runs in the batch step of an `sbatch` job (or under `salloc`). The
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
straight into the record. What Slurm is asked (the allocation, node states, addresses, a
requeued job's checkpoint) is `ffctl.backends.slurm_cluster`; the steps are
`ffctl.backends.slurm_steps`.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from fault_injectors.deadman import DEADMAN_PREFIX, RECORD_NAME, safe_id
from fault_injectors.node import DRAIN_REASON_PREFIX, is_node_drain, is_node_kill, resume_argv
from fault_injectors.plan import HostCommand
from fault_injectors.revert import SHM_SWEEP
from wire.fault_spec import FaultKind
from fault_injectors.transport import LocalTransport, Transport
from ffctl.agent.config import AgentConfig
from ffctl.backends.protocol import AgentLaunch
from ffctl.backends.slurm_cluster import (
    COMMAND_TIMEOUT_S,
    NODENAME_ENV,
    NodeStatePoller,
    Runner,
    allocation,
    bindable,
    check_requeue,
    interface_of,
    is_out,
    node_address,
    node_state,
    restart_count,
    resume_checkpoint,
    route_source,
    split_nodes,
)
from ffctl.backends.slurm_steps import STEP_END_S, SlurmStep, SlurmTransport, StepKill, agent_argv
from ffctl.exits import InfraError
from ffctl.launch_spec import LaunchSpec
from runs.events import EventKind
from runs.shm import SHM_ROOT
from runs.store import RunStore


def probe_interface(job: str, run_id: str, host: str, address: str) -> str:
    """The interface of Slurm node `host`'s `address` (gloo is pinned to it), asked there by a
    step of its own; InfraError when it cannot be told."""
    if ipaddress.ip_address(address).is_loopback:
        return "lo"
    out = SlurmTransport(job, host, f"ffctl-{run_id}-probe").run(["ip", "-o", "addr", "show"], timeout=COMMAND_TIMEOUT_S)
    iface = interface_of(address, out.stdout) if out.ok else None
    if iface is None:
        raise InfraError(f"Slurm node {host}: cannot tell the interface of its address {address} ({out.describe()})")
    return iface


def store_address(first: str, run: Runner = subprocess.run) -> str:
    """The address of this host the controller's store listens on, where `--master-addr` names
    none: the address of the Slurm node this runs on, else (under salloc the shell may be on a
    login node) our source address toward the first node, at `first`."""
    here = os.environ.get(NODENAME_ENV, "")
    candidates = [node_address(here, run)] if here else []
    candidates += [first] if ipaddress.ip_address(first).is_loopback else [route_source(first, run)]
    for addr in candidates:
        if addr and bindable(addr):
            return addr
    raise InfraError(f"cannot tell which address of this host ({here or socket.gethostname()}) the Slurm "
                     "nodes reach; give --master-addr")


@dataclass
class _Slot:
    """Which Slurm node runs a node now, and its step."""

    host: str
    step: SlurmStep | None = None


# A drained node's dead man's switch, on the batch host beside the launch: it waits while the
# launch ($1, its pid) lives; once the launch is gone without resuming the node (SIGKILLed,
# killed for memory) it resumes node $2 if its reason still begins with the fault's mark ($3:
# nobody drained it again since for a reason of their own), and appends its line to the record
# ($4), as `fault_injectors.deadman`'s switches do. SIGTERM: the launch resumed the node itself;
# SIGUSR1: resume now (`ffctl inject revert --all`). $0 is the owner tag those find it by.
DRAIN_SWITCH = r"""trap '' HUP INT
p= f=
trap '[ -z "$p" ] || kill "$p" 2>/dev/null; exit 0' TERM
trap 'f=1; [ -z "$p" ] || kill "$p" 2>/dev/null' USR1
while [ -z "$f" ] && kill -0 "$1" 2>/dev/null; do sleep 1 & p=$!; wait "$p"; p=; done
trap '' TERM USR1
rc=0
case $(sinfo --noheader --nodes="$2" --format=%E 2>/dev/null) in
  "$3"*) scontrol update nodename="$2" state=resume >/dev/null 2>&1 </dev/null || rc=$? ;;
esac
t=$(date +%s.%N 2>/dev/null); case $t in ''|*[!0-9.]*|.*|*.) t=$(date +%s 2>/dev/null) ;; esac
case $t in ''|*[!0-9.]*) t=null ;; esac
w=controller-gone; [ -z "$f" ] || w=signal
ok=true; [ "$rc" -eq 0 ] || ok=false
{ printf '{"fault_id":"%s","t":%s,"by":"deadman","trigger":"%s","ok":%s,"exit":%d}\n' \
    "${0##*:}" "$t" "$w" "$ok" "$rc" >>"$4"; } 2>/dev/null || :
"""


def drain_switch(popen: Callable[..., subprocess.Popen[bytes]], log_dir: Path, run_id: str, host: str,
                 reason: str) -> subprocess.Popen[bytes]:
    """Start the dead man's switch of a node about to be drained (`DRAIN_SWITCH`), watching this
    process: detached (its own session), so that the launch killed leaves it running."""
    record = log_dir / RECORD_NAME
    record.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{DEADMAN_PREFIX}:{safe_id(run_id)}:{safe_id(reason.rpartition(':')[2])}"
    mark = reason.rpartition(":")[0] + ":"  # ffctl:<run>:, whatever fault of the run drained it
    return popen(["sh", "-c", DRAIN_SWITCH, tag, str(os.getpid()), host, mark, str(record)],
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def stop_switches(switches: dict[str, subprocess.Popen[bytes]]) -> None:
    """End drain switches whose nodes the launch resumed itself (or left to the sweep)."""
    for switch in switches.values():
        switch.terminate()
        try:
            switch.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            switch.kill()
    switches.clear()


def plan_notes(spec: LaunchSpec) -> list[str]:
    """The dry run's words on how Slurm carries out the spec's node faults."""
    notes = []
    if spec.chaos or any(f.kind in (FaultKind.KILL_NODE, FaultKind.REBOOT_NODE) for f in spec.injects):
        notes.append("on Slurm a node's `kill -KILL` is its agent step cancelled (scancel --signal=KILL JOB.STEP); "
                     "the node comes back on a spare node while the allocation has one (each spare node runs a "
                     "standby agent, its worker template warm)")
    if any(f.option("drain") == "yes" for f in spec.injects):
        notes.append("a node drained by drain=yes is resumed (scontrol update nodename=NODE state=resume) when the "
                     "launch ends, or by `ffctl inject revert --all --run RUN` after a killed launch")
    return notes


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
        self._switches: dict[str, subprocess.Popen[bytes]] = {}  # host -> its drain's dead man's switch
        self.resumed: list[str] = []
        self.out_nodes: dict[str, str] = {}  # host -> Slurm's state and reason, when it took a node out
        self._left: dict[str, int] = {}  # host -> the node that left it for a spare node
        self._poller = NodeStatePoller(self._hosts_in_use, self.check_nodes, run)
        self.python = sys.executable  # each agent's: the launch's own, on a filesystem every node mounts

    @classmethod
    def for_launch(cls, spec: LaunchSpec, run_id: str, env: Mapping[str, str] | None = None) -> SlurmNodes:
        env = os.environ if env is None else env
        job, names = allocation(env)
        hosts, spares = split_nodes(spec, names)
        # A requeue past --max-restarts is refused in `admit` (the launch knows the bound, from
        # the script); a requeued job resumes in `attach`.
        return cls(job, hosts, spares, run_id, spec.master_addr, restarts=restart_count(env))

    # -- the launch's lifecycle -----------------------------------------------------------------
    def prepare(self) -> str:
        """Every node's address (and interface), and the address of this node the controller's
        store listens on: ``--master-addr``, else the address of the node this runs on."""
        for host in [s.host for s in self._slots] + self.spare_hosts:
            self._addresses[host] = node_address(host, self._run)
        for host in [s.host for s in self._slots] + self.spare_hosts:
            self._interfaces[host] = probe_interface(self.job, self.run_id, host, self._addresses[host])
        return self._master_addr or store_address(self._addresses[self._slots[0].host], self._run)

    def attach(self, record: RunStore) -> None:
        self.log_dir = record.path / "logs"
        self._record = record
        if self.restarts:
            self.resumed_from = resume_checkpoint(record, self.job)
        self._note()
        self._poller.start()

    # -- what Slurm says of the nodes -----------------------------------------------------------
    def _hosts_in_use(self) -> list[str]:
        return [s.host for s in self._slots] + self.spare_hosts + self.failed_hosts

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
        self._poller.stop()
        for host in list(self.drained):
            try:
                done = self._run(resume_argv(host), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                                 check=False).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                done = False  # `ffctl inject revert --all` finds it by its reason
            if done:
                self.resumed.append(host)
        stop_switches(self._switches)  # resumed above, or left to `ffctl inject revert --all`
        for step in self._standby.values():
            step.stop(STEP_END_S)
        for step in self._steps:
            if step.poll() is None:
                step.cancel("KILL", STEP_END_S)
            step.close()
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

    def scheduled_hosts(self) -> list[str] | None:
        return [s.host for s in self._slots]

    def plan_notes(self, spec: LaunchSpec) -> list[str]:
        return plan_notes(spec)

    def admit(self, requeue_bound: int) -> None:
        """A job Slurm requeued (SLURM_RESTART_COUNT) more often than `requeue_bound` starts
        nothing: NoRequeue, exit 4."""
        if self.restarts:
            check_requeue(self.restarts, requeue_bound)

    def agent_launch(self, node: int) -> AgentLaunch:
        """The agent step of `node`'s next start: on the Slurm node it runs on now, named for the
        run, the node and the count of its starts (unique, so `squeue` finds its JOB.STEP)."""
        host = self._slots[node].host
        name = f"ffctl-{self.run_id}-node{node}-{self._starts.get(node, 0) + 1}"
        return AgentLaunch(node, tuple(agent_argv(self.job, host, name, self.python)),
                           f"as a step (srun --overlap) on Slurm node {host}")

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

    def _launch(self, cfg: AgentConfig, host: str, name: str, log_name: str, argv: Sequence[str]) -> SlurmStep:
        """The agent step `argv` (named `name`) on `host`, `cfg` its stdin's first line."""
        assert self.log_dir is not None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / log_name, "ab")
        try:
            proc = self._popen(list(argv), stdin=subprocess.PIPE,
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
                name = f"ffctl-{self.run_id}-spare-{host}"
                try:
                    self._standby[host] = self._launch(standby, host, name, f"agent-spare-{host}.log",
                                                       agent_argv(self.job, host, name, self.python))
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
        """Node `cfg.node`'s agent as a step (`agent_launch`). A node whose earlier step was ended
        (a node fault) moves to a spare node while the allocation has one, and its standby agent
        takes the node (no new step starts then)."""
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
            launch = self.agent_launch(cfg.node)
            n = self._starts[cfg.node] = self._starts.get(cfg.node, 0) + 1
        # Where the agent listens is where its node is now (a spare node has its own address).
        cfg = self._placed(cfg, slot.host)
        step = self._adopt(cfg, slot.host) if moved else None
        if step is None:
            step = self._launch(cfg, slot.host, f"ffctl-{self.run_id}-node{cfg.node}-{n}", f"agent-{cfg.node}.log",
                                launch.argv)
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
            # scontrol runs here (the batch step); the launch's end resumes the node, and if the
            # launch dies first, the switch does.
            self.drained[cmd.host] = cmd.about or ""
            if cmd.host not in self._switches and self.log_dir is not None:
                self._switches[cmd.host] = drain_switch(self._popen, self.log_dir / str(max(cmd.node, 0)),
                                                        self.run_id, cmd.host, self.drained[cmd.host])
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
