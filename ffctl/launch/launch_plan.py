"""`ffctl launch` as a library: validate and plan (pure), then execute.

`plan_launch` checks everything a user can get wrong before anything starts (`LaunchSpec.validate`,
then what needs this machine: root for a sandbox, the runs dir, each fault's tools) and returns
what would run, each node's agent argv asked of the backend that will run it
(`LaunchBackend.agent_launch`, the very request its `start` runs); `execute` is the one path for
every node backend (`ffctl.backends`: local, netns sandbox, SSH, Slurm): the backend prepares the
nodes and names the controller's address, the run record is created, the controller runs over
the backend, and the backend cleans up however the run ends.
"""
from __future__ import annotations

import os

import platform
import shlex
import signal
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from fault_injectors import FaultSpecError, NodePlace, RankPlace, Target, TargetMode, Topology
from fault_injectors.network import preflight
from fault_injectors.schedule import parse_chaos, with_seed
from wire.fault_spec import FaultSpec
from fault_injectors.transport import LocalTransport
from ffctl import __version__
from ffctl.backends import BACKENDS, backend_name
from ffctl.backends.protocol import LaunchBackend
from ffctl.exits import BadInput
from ffctl.launch.timeouts import findings, read_timeouts
from ffctl.controller.faultplan import chaos_faults, plan_fault
from ffctl.launch_spec import LaunchSpec, SpecError
from runs import shm
from runs.events import RunStatus
from runs.metrics import run_strategy
from runs.store import RunStore, RunStoreError, new_run_id, validate_run_id

if TYPE_CHECKING:
    from ffctl.backends.netns import NetnsSandbox

CHAOS_PREVIEW = 5  # chaos faults `--dry-run` lists


@dataclass(frozen=True)
class LaunchPlan:
    spec: LaunchSpec
    run_id: str
    lines: tuple[str, ...]
    # Timeouts in an order that defeats recovery, or detection over a minute (launch.timeouts).
    warnings: tuple[str, ...] = ()
    chaos_seed_drawn: int | None = None  # `--chaos` without seed=: the one drawn for this run


def _static_topology(spec: LaunchSpec, run_id: str, hosts: list[str] | None = None) -> Topology:
    # Placeholder pids: enough to check targets and print commands before anything exists.
    nodes = tuple(NodePlace(n, "localhost", "127.0.0.1", 10_000 + n, interface="lo") for n in range(spec.nnodes))
    if hosts:
        # Hosts' addresses are learnt when the launch checks them: documentation addresses
        # (RFC 5737) stand in, distinct per host as the real ones are.
        nodes = tuple(NodePlace(n, h, f"192.0.2.{n + 1}", 10_000 + n, interface="eth0") for n, h in enumerate(hosts))
    ranks = tuple(RankPlace(r, r // spec.nproc_per_node, 20_000 + r) for r in range(spec.world_size))
    return Topology(run_id, nodes, ranks, record_dir=_record_dir(spec, run_id, bool(hosts)),
                    fault_dir=_shm_dir(run_id))


def _shm_dir(run_id: str) -> str:
    """The run's shared-memory directory as a plan shows it: its key is drawn when it starts."""
    return str(shm.run_dir(shm.SHM_ROOT, run_id, "<key>"))


def _record_dir(spec: LaunchSpec, run_id: str, remote: bool) -> str:
    """The run directory as the target hosts will see it (where dead man's switches record their
    reverts), as the controller will give it: the remote run dir over SSH, else the record."""
    if remote:
        return f"{spec.remote_runs_dir.rstrip('/') or ''}/{run_id}"
    return str((spec.runs_dir / run_id).absolute())


def plan_launch(spec: LaunchSpec) -> LaunchPlan:
    hosts: list[str] | None = None
    if spec.hostfile is not None:
        from ffctl.hosts.ssh.preflight import hosts_spec

        spec, entries = hosts_spec(spec)  # one node per host, slots= ranks each
        hosts = [e.name for e in entries]
    try:
        spec.validate()
        run_id = validate_run_id(spec.run_id) if spec.run_id else new_run_id()
        RunStore.check_writable(spec.runs_dir)
    except (SpecError, RunStoreError) as exc:
        raise BadInput(str(exc)) from None
    if (spec.runs_dir / run_id).exists():
        raise BadInput(f"run id {run_id!r} already exists in {str(spec.runs_dir)!r}")
    if spec.hostfile is None and spec.backend is None and shm.live_twins(_shm_dir(run_id), run_id, 0):
        # Nodes on this host: another run of this id holds its snapshot slots here. Said now,
        # before a record is made and agents started only to be refused one by one.
        raise BadInput(f"run id {run_id!r} is in use on this host: another ffctl run holds its snapshot slots; "
                       "give this run another --run-id")
    sandbox = _preview_sandbox(spec, run_id) if spec.sandbox is not None else None
    # The backend that will run the nodes, made as `execute` makes it (building and connecting
    # nothing): outside a Slurm allocation, or with a bad --master-addr, this is one line, exit 2.
    backend = BACKENDS[backend_name(spec)](spec, run_id)
    scheduled = backend.scheduled_hosts()
    topo = _static_topology(spec, run_id, hosts or scheduled)
    if scheduled:
        # The record is on a filesystem the allocation's nodes share, as it is here.
        topo = replace(topo, record_dir=_record_dir(spec, run_id, False))
    if sandbox is not None:
        topo = _sandbox_topology(spec, run_id, sandbox)
    # A script trains its own steps: --steps is the built-in GPT's, no total of the script's.
    steps = "the script's own steps" if spec.script else f"{spec.steps} steps"
    recovery = spec.recovery
    plain = False
    if spec.script:
        # What the controller will do: a plain script gets torchrun's group restart, whatever
        # --recovery says (imported here: the controller module brings torch with it).
        from ffctl.controller.script import uses_recovery_library

        plain = not uses_recovery_library(spec.script)
        recovery = run_strategy(spec.recovery, plain)
    refuse_unfireable(spec)
    drawn = None
    if spec.chaos:
        chaos_text, drawn = with_seed(spec.chaos)
        spec = replace(spec, chaos=chaos_text)  # recorded with the run: its schedule can be repeated
    lines = [f"run {run_id}: {spec.nnodes} node(s) x {spec.nproc_per_node} rank(s), {steps}, "
             f"recovery {recovery}" + (f", checkpoint every {spec.ckpt_every}" if spec.ckpt_every else "")
             + (f", {spec.spares} warm spare(s) per node" if spec.spares else "")]
    worker = " ".join(shlex.quote(a) for a in spec.script) if spec.script else f"built-in GPT ({spec.model}{'' if spec.parallel == 'ddp' else ', ' + spec.parallel})"
    for n in range(spec.nnodes):
        ranks = [r for r in range(spec.world_size) if r // spec.nproc_per_node == n]
        # The very argv the backend's `start` will run for this node's agent.
        where = backend.agent_launch(n).describe()
        if sandbox is not None:
            place = topo.node(n)
            where += f" (address {place.address}, interface {place.interface})"
        lines.append(f"node {n}: agent {where}, ranks {ranks}: {worker}")
    if sandbox is not None:
        lines.insert(1, f"sandbox: bridge {sandbox.bridge} on {sandbox.subnet}, the controller's store on "
                        f"{sandbox.controller_address}, one network namespace per node (removed at exit)")
    lines += _fault_lines(spec, topo, probe=hosts is None and scheduled is None)
    lines += backend.plan_notes(spec)
    warnings = timeout_findings(spec, plain)
    lines += [f"timeouts: {w}" for w in warnings]
    return LaunchPlan(spec, run_id, tuple(lines), tuple(warnings), drawn)


def timeout_findings(spec: LaunchSpec, plain: bool) -> list[str]:
    """What the launch's detection timeouts say (ffctl.launch.timeouts): the script's own
    process-group timeout where its source shows it, the environment's NCCL settings."""
    source = _script_source(spec)
    found = read_timeouts(heartbeat_s=spec.heartbeat_timeout, hang_s=spec.hang_min_s, script_source=source,
                          library=not plain, env=os.environ, rdzv_conf=dict(spec.torchrun).get("rdzv_conf", ""))
    from ffctl.controller.script import steps_seen

    return findings(found, steps_known=steps_seen(spec.script, spec.step_regex))


def _script_source(spec: LaunchSpec) -> str | None:
    if not spec.script or spec.script[0].startswith("-"):
        return None
    try:
        with open(spec.script[0], "rb") as fh:
            return fh.read(1 << 20).decode("utf-8", errors="replace")
    except OSError:
        return None


def refuse_unfireable(spec: LaunchSpec) -> None:
    """A step fault in a script whose steps ffctl will never see is refused before anything starts
    (one line, exit 2), unless --allow-missed: then it runs and the fault is recorded as missed at
    the end. (A step past the built-in GPT's --steps is refused by the spec itself.)"""
    from ffctl.controller.script import steps_seen

    if spec.allow_missed or not spec.script or steps_seen(spec.script, spec.step_regex):
        return
    for fault in spec.injects:
        step = fault.trigger.step
        if step is None:
            continue
        raise BadInput(f"--inject {fault}: step={step} can never fire: the script reports no steps (call "
                       f"recovery.report_step(step, loss) after each one, or pass --step-regex); use t= "
                       f"(seconds from its first step) or --allow-missed")


def _preview_sandbox(spec: LaunchSpec, run_id: str) -> NetnsSandbox:
    from ffctl.backends.netns import NetnsSandbox, SandboxError, require_root

    try:
        require_root()
        return NetnsSandbox(run_id, spec.nnodes).preview()
    except SandboxError as exc:
        raise BadInput(str(exc)) from None


def _sandbox_topology(spec: LaunchSpec, run_id: str, sb: NetnsSandbox) -> Topology:
    # The layout `execute` will create (the same run id picks the same free subnet).
    nodes = tuple(sb.node_place(n, 10_000 + n) for n in range(spec.nnodes))
    ranks = tuple(RankPlace(r, r // spec.nproc_per_node, 20_000 + r) for r in range(spec.world_size))
    return Topology(run_id, nodes, ranks, controller_address=sb.controller_address,
                    record_dir=_record_dir(spec, run_id, False), fault_dir=_shm_dir(run_id))


def _probe_transport(cmd: Any) -> LocalTransport:
    # Launch-time preflight runs on this machine itself: the namespaces do not exist yet, and
    # they will share this kernel, its tools and its qdiscs.
    return LocalTransport(cmd.host, None)


def _checked(fault: FaultSpec, topo: Topology, fault_id: str, what: str, probe: bool) -> list[str]:
    """Plan one fault as the injector will, preflight it where that needs no live process, and
    return its dry-run lines; a fault that cannot work is bad input (exit 2, nothing started)."""
    try:
        plan = plan_fault(fault, topo, fault_id)
        if probe:
            # The namespace-free twin of the plan: tools, iptables, the kernel's qdiscs.
            local = replace(topo, nodes=tuple(replace(n, netns=None, interface="lo") for n in topo.nodes))
            preflight(plan_fault(fault, local, fault_id), _probe_transport)
    except FaultSpecError as exc:
        raise BadInput(f"{what}: {exc}") from None
    return [f"  {line}" for line in plan.describe()[1:]]


def _fault_lines(spec: LaunchSpec, topo: Topology, probe: bool) -> list[str]:
    """Every scheduled and chaos fault checked up front, with the commands each host will run.
    Fault ids are given as the injector gives them: scheduled faults first, in order."""
    lines: list[str] = []
    for i, fault in enumerate(spec.injects, start=1):
        body = _checked(fault, topo, f"f{i}", f"--inject {fault.kind.value}", probe)
        # A script's step is its own, as it reports it: the trigger waits on its output.
        on_output = " on the script's own reported step" if spec.script and fault.trigger.step is not None else ""
        lines.append(f"fault f{i}: {fault} (fires{on_output}; pids resolved when it fires):")
        lines += body
    if spec.chaos:
        try:
            chaos = parse_chaos(spec.chaos)
        except FaultSpecError as exc:
            raise BadInput(f"--chaos: {exc}") from None
        for kind in chaos.kinds:  # every kind it may draw must be possible here
            _checked(FaultSpec(kind, Target(TargetMode.ONE)), topo, "chaos", f"--chaos kinds={kind.value}", probe)
        lines.append(f"chaos {chaos}: faults drawn at run time, from fault f{len(spec.injects) + 1} on; the first:")
        for _, (t, fault) in zip(range(CHAOS_PREVIEW), chaos_faults(chaos)):
            lines.append(f"  t={t:g}s {fault.kind.value} {fault.target} seed={fault.seed}")
    return lines


def run_info(plan: LaunchPlan) -> dict[str, Any]:
    import torch

    spec = plan.spec
    return {
        "run_id": plan.run_id,
        "spec": {"nnodes": spec.nnodes, "nproc_per_node": spec.nproc_per_node, "steps": spec.steps,
                 "seed": spec.seed, "model": spec.model, "recovery": spec.recovery, "ckpt_every": spec.ckpt_every,
                 "spares": spec.spares, "injects": [str(f) for f in spec.injects], "script": list(spec.script),
                 "sandbox": spec.sandbox, "backend": backend_name(spec), "chaos": spec.chaos, "max_restarts": spec.max_restarts,
                 "role": spec.role, "torchrun": dict(spec.torchrun)},
        "hosts": ["localhost"] * spec.nnodes,
        "versions": {"ffctl": __version__, "torch": torch.__version__, "python": platform.python_version()},
    }


def requeue_bound(spec: LaunchSpec) -> int:
    """The requeues a scheduler's job may have: its --max-restarts, or the default the controller
    applies (torchrun's 0 for an unchanged script, 3 for the built-in GPT and the recovery library)."""
    if spec.max_restarts is not None:
        return spec.max_restarts
    from ffctl.launch_spec import LIBRARY_MAX_RESTARTS, PLAIN_MAX_RESTARTS

    if spec.script:
        from ffctl.controller.script import uses_recovery_library

        return LIBRARY_MAX_RESTARTS if uses_recovery_library(spec.script) else PLAIN_MAX_RESTARTS
    return LIBRARY_MAX_RESTARTS


def execute(plan: LaunchPlan, view: Callable[[dict[str, Any]], None]) -> tuple[RunStatus, RunStore]:
    """Run the plan: the backend prepares the nodes and says where the controller listens, the
    record is created, the controller runs over the backend, and the backend cleans up however
    it ends (Ctrl-C and SIGTERM included)."""
    from ffctl.controller.controller import Controller

    backend: LaunchBackend = BACKENDS[backend_name(plan.spec)](plan.spec, plan.run_id)
    backend.admit(requeue_bound(plan.spec))  # a job requeued too often starts nothing
    previous = signal.getsignal(signal.SIGTERM)
    previous_int = signal.getsignal(signal.SIGINT)
    # SIGTERM unwinds like Ctrl-C from here on, so what the backend built goes in either case.
    # SIGINT is set too (as torchrun's agent does): a launch started as a background job of a
    # script inherits SIGINT ignored, and `kill -INT` must still stop it.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    record: RunStore | None = None
    try:
        spec = replace(plan.spec, address=backend.prepare())
        info = {**run_info(plan), "hosts": [backend.host(n) for n in range(spec.nnodes)]}
        try:
            record = RunStore.create(spec.runs_dir, plan.run_id, info)
        except RunStoreError as exc:
            raise BadInput(str(exc)) from None
        backend.attach(record)
        status = Controller(spec, record, backend, view).run()
        return status, record
    finally:
        # A second Ctrl-C or SIGTERM must not cut the clean-up short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            backend.release(record)
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
