"""The control plane at scale: a real controller, N simulated nodes, one of them lost.

For each cluster size the real `Controller` runs a job of N simulated agents (one rank each by
default) through `SimNodes`, in this process, as `ffctl launch` runs one: the same store, the
same sealed messages, heartbeats, detection, recovery coordinator, decision and plan. Once step
`kill_step` is committed the simulator silences node N/2 (no heartbeat, no word from it or its
ranks, as when a host is lost), and the run record and the simulator say when each phase of
the recovery's control plane ended:

- detection: the node lost (`node_lost`, by its heartbeat) after it went silent;
- decision: the recovery decided (`recovery_decided`: abort acknowledged, inventories in);
- plan published: the new generation's plan read by every rank (the simulator's last read);
- joined: every rank joined and restored (`restore_done`, after `rendezvous_done`).

Beside them, the controller's and the simulator's CPU as a share of a core over the steady
steps before the fault, and the store's key count.
"""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from ffctl.sim.agents import HEARTBEAT_S, SimSpec
from ffctl.sim.nodes import SimNodes
from ffctl.launch_spec import LaunchSpec
from runs.events import EventKind
from runs.store import RunStore

KILL_STEP = 4  # the node is lost once this step is committed
STEPS_AFTER = 3  # steps trained after the recovery, so the job is seen running again
# A step every 2 s: at 1,024 ranks the controller reads 1,024 step reports a step (each a message
# of its queue), and the simulator on the same 2 cores takes about as long to send them.
STEP_S = 2.0
PHASES = ("detection", "decision", "plan_published", "joined")


def _first(events: list[Any], kind: EventKind, **match: Any) -> Any | None:
    return next((e for e in events if e.kind is kind and all(e.get(k) == v for k, v in match.items())), None)


def run_size(nodes: int, runs_dir: Path, step_s: float = STEP_S, kill_step: int = KILL_STEP,
             steps_after: int = STEPS_AFTER, heartbeat_timeout: float = 1.0) -> dict[str, Any]:
    """One job of `nodes` simulated nodes with a node lost; its control-plane phases."""
    from ffctl.controller.controller import Controller  # torch's store: only when a bench runs

    kill_node = nodes // 2
    steps = kill_step + 1 + steps_after
    run_id = f"control-plane-{nodes}-{uuid.uuid4().hex[:6]}"
    spec = LaunchSpec(nnodes=nodes, nproc_per_node=1, steps=steps, runs_dir=runs_dir, run_id=run_id,
                      heartbeat_timeout=heartbeat_timeout).validate()
    record = RunStore.create(runs_dir, run_id, {"run_id": run_id, "backend": "sim", "nnodes": nodes})
    sim = SimNodes(SimSpec(steps=steps, step_s=step_s, kill_node=kill_node, kill_step=kill_step),
                   record.path / "logs" / "sim.log")
    t0 = time.monotonic()
    try:
        status = Controller(spec, record, sim).run()
    finally:
        summary = sim.finish()
    wall = time.monotonic() - t0
    events = list(record.events())
    return {"run_id": run_id, **figures(nodes, kill_node, str(status.value), events, sim.events, summary or {}, wall)}


def figures(nodes: int, kill_node: int, status: str, events: list[Any], sim_events: list[dict[str, Any]],
            summary: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """The phases and figures of one run, from its record and the simulator's lines."""
    killed = next((e for e in sim_events if e.get("ev") == "killed"), None)
    lost = _first(events, EventKind.NODE_LOST, node=kill_node)
    decided = _first(events, EventKind.RECOVERY_DECIDED)
    gen = int(decided.get("gen")) if decided is not None else None
    joined = _first(events, EventKind.RENDEZVOUS_DONE, gen=gen) if gen is not None else None
    restored = _first(events, EventKind.RESTORE_DONE, gen=gen) if gen is not None else None
    plan = (summary.get("plans") or {}).get(str(gen)) if gen is not None else None
    out: dict[str, Any] = {"nodes": nodes, "ranks": nodes, "status": status, "killed_node": kill_node,
                           "wall_s": round(wall_s, 3), "recovered_gen": gen}
    # CPU over the steady steps before the fault: from the second step mark to the last one.
    steady = [e for e in sim_events if e.get("ev") == "step" and int(e["gen"]) == 0
              and (killed is None or float(e["t"]) < float(killed["t"]))]
    if len(steady) >= 3:
        a, b = steady[1], steady[-1]
        span = float(b["received"]) - float(a["received"])
        if span > 0:
            ctl = (float(b["controller_cpu_s"]) - float(a["controller_cpu_s"])) / span
            out["controller_cpu_share"] = round(ctl, 4)
            out["sim_cpu_share"] = round((float(b["cpu_s"]) - float(a["cpu_s"])) / span, 4)
            # Per heartbeat, as if the controller did nothing else meanwhile (an upper bound).
            out["controller_cpu_ms_per_heartbeat"] = round(1000.0 * ctl / (nodes / HEARTBEAT_S), 4)
        out["store_keys"] = b.get("keys")
        out["step_send_s"] = max(float(e["sent_s"]) for e in steady)  # the simulator's N step reports
    if killed is None or lost is None or decided is None or restored is None or joined is None or plan is None:
        out["complete"] = False
        return out
    t_kill = float(killed["t"])
    marks = [float(t_kill), float(lost.t), float(decided.t), float(plan["last"]), float(restored.t)]
    out.update({
        "complete": True,
        "detection_s": marks[1] - marks[0],
        "decision_s": marks[2] - marks[1],
        "plan_published_s": marks[3] - marks[2],
        "plan_first_read_s": float(plan["first"]) - marks[2],
        "joined_s": marks[4] - marks[3],
        "rendezvous_done_s": float(joined.t) - marks[3],
        "recovery_s": marks[4] - marks[0],
        "after_detection_s": marks[4] - marks[1],
        "plan_reads": int(plan["reads"]),
        "lost_reason": lost.get("reason"),
    })
    started = _first(events, EventKind.RUN_STARTED)
    first_step = _first(events, EventKind.STEP)
    if started is not None and first_step is not None:
        out["startup_s"] = round(float(first_step.t) - float(started.t), 3)
    return out


def run_control_plane(sizes: list[int], runs_dir: Path, step_s: float = STEP_S) -> list[dict[str, Any]]:
    """`run_size` for each cluster size, smallest first."""
    return [run_size(n, runs_dir, step_s=step_s) for n in sorted(sizes)]
