"""`ffctl launch` as a library: validate and plan (pure), then execute.

`plan_launch` checks everything a user can get wrong before anything starts (counts, strategy,
fault specs and their targets, the runs dir) and returns what would run; `execute` creates the
run record, starts the controller and returns the final status.
"""
from __future__ import annotations

import platform
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Callable

from fault_injectors import FaultSpecError, NodePlace, RankPlace, Topology, make_plan
from ffctl import __version__
from ffctl.errors import BadInput
from ffctl.launchspec import LaunchSpec, SpecError
from runs.events import RunStatus
from runs.store import RunStore, RunStoreError, new_run_id, validate_run_id


@dataclass(frozen=True)
class LaunchPlan:
    spec: LaunchSpec
    run_id: str
    lines: tuple[str, ...]


def _static_topology(spec: LaunchSpec, run_id: str, hosts: list[str] | None = None) -> Topology:
    # Placeholder pids: enough to check targets and print commands before anything exists.
    nodes = tuple(NodePlace(n, "localhost", "127.0.0.1", 10_000 + n, interface="lo") for n in range(spec.nnodes))
    if hosts:
        # Hosts' addresses are learnt when the launch checks them: documentation addresses
        # (RFC 5737) stand in, distinct per host as the real ones are.
        nodes = tuple(NodePlace(n, h, f"192.0.2.{n + 1}", 10_000 + n, interface="eth0") for n, h in enumerate(hosts))
    ranks = tuple(RankPlace(r, r // spec.nproc_per_node, 20_000 + r) for r in range(spec.world_size))
    return Topology(run_id, nodes, ranks)


def plan_launch(spec: LaunchSpec) -> LaunchPlan:
    hosts: list[str] | None = None
    if spec.hostfile is not None:
        from ffctl.ssh_nodes import hosts_spec

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
    topo = _static_topology(spec, run_id, hosts)
    lines = [f"run {run_id}: {spec.nnodes} node(s) x {spec.nproc_per_node} rank(s), {spec.steps} steps, "
             f"recovery {spec.recovery}" + (f", checkpoint every {spec.ckpt_every}" if spec.ckpt_every else "")
             + (f", {spec.spares} warm spare(s) per node" if spec.spares else "")]
    worker = " ".join(shlex.quote(a) for a in spec.script) if spec.script else f"built-in GPT ({spec.model})"
    for n in range(spec.nnodes):
        ranks = [r for r in range(spec.world_size) if r // spec.nproc_per_node == n]
        where = f"`{spec.remote_python} -m ffctl.agent` over SSH on {hosts[n]}" if hosts else \
            f"`{sys.executable} -m ffctl.agent` on localhost"
        lines.append(f"node {n}: agent {where}, ranks {ranks}: {worker}")
    for fault in spec.injects:
        try:
            plan = make_plan(fault, topo)
        except FaultSpecError as exc:
            raise BadInput(f"--inject {fault.kind.value}: {exc}") from None
        lines.append(f"fault {fault} (pids resolved when it fires):")
        lines += [f"  {line}" for line in plan.describe()[1:]]
    return LaunchPlan(spec, run_id, tuple(lines))


def run_info(plan: LaunchPlan) -> dict[str, Any]:
    import torch

    spec = plan.spec
    return {
        "run_id": plan.run_id,
        "spec": {"nnodes": spec.nnodes, "nproc_per_node": spec.nproc_per_node, "steps": spec.steps,
                 "seed": spec.seed, "model": spec.model, "recovery": spec.recovery, "ckpt_every": spec.ckpt_every,
                 "spares": spec.spares, "injects": [str(f) for f in spec.injects], "script": list(spec.script),
                 "sandbox": spec.sandbox},
        "hosts": ["localhost"] * spec.nnodes,
        "versions": {"ffctl": __version__, "torch": torch.__version__, "python": platform.python_version()},
    }


def execute(plan: LaunchPlan, view: Callable[[dict[str, Any]], None]) -> tuple[RunStatus, RunStore]:
    from ffctl.controller import Controller
    from ffctl.nodes import LocalNodes

    if plan.spec.hostfile is not None:
        from ffctl.ssh_nodes import execute_over_ssh

        return execute_over_ssh(plan.spec, plan.run_id, run_info(plan), view)
    try:
        record = RunStore.create(plan.spec.runs_dir, plan.run_id, run_info(plan))
    except RunStoreError as exc:
        raise BadInput(str(exc)) from None
    nodes = LocalNodes(record.path / "logs")
    status = Controller(plan.spec, record, nodes, view).run()
    return status, record
