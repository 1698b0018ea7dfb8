"""Failures ffctl did not inject show in `ffctl report` as faults of kind `detected`.

A rank of a running built-in job is SIGKILLed from outside (its pid from the record's
`ranks_spawned`), then a node's agent is SIGSTOPped (its pid from `agent_started`): the job
recovers from both and completes with the losses of a fault-free run, and the report lists both
as faults with their cause and lost time.

A stopped agent does not stop its ranks: the controller must end them itself before the next
generation opens, or they join it beside their replacements (the job then hung and stopped over
a recovery that named no lost rank).
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from runs.events import Event, EventKind
from runs.store import iter_events
from tests.helpers.launch import (
    assert_nothing_left, launch, rid, run_ffctl, start_launch, wait_event, wait_step,
)

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _last(events_path: Path, kind: EventKind, **match: object) -> Event:
    found = [ev for ev in iter_events(events_path) if ev.kind is kind
             and all(ev.get(k) == v for k, v in match.items())]
    assert found, f"no {kind.value} event with {match}"
    return found[-1]


def test_a_rank_killed_and_an_agent_stopped_from_outside_are_detected_faults(tmp_path: Path) -> None:
    # Both faults are over within about 60 steps (1 s heartbeat timeout, a step being about 50 ms
    # here; a slower host takes fewer steps for it); 130 leave room.
    args = ("--nnodes", "2", "--nproc-per-node", "2", "--steps", "130", "--spares", "1")
    base = launch(tmp_path, rid("base"), *args)
    assert base.returncode == 0, base.stderr
    run_id = rid("outside")
    events = tmp_path / "runs" / run_id / "events.jsonl"
    proc = start_launch(tmp_path, run_id, *args)
    stopped_agent: int | None = None
    try:
        wait_step(tmp_path / "runs", run_id, 10, timeout=240)
        pid = int(_last(events, EventKind.RANKS_SPAWNED, gen=0).get("pids")["1"])
        os.kill(pid, signal.SIGKILL)
        first = wait_event(events, lambda ev: ev.kind is EventKind.RESTORE_DONE, 180)
        wait_step(tmp_path / "runs", run_id, int(first.get("step")) + 8, timeout=180)

        stopped_agent = int(_last(events, EventKind.AGENT_STARTED, node=1).get("pid"))
        os.kill(stopped_agent, signal.SIGSTOP)
        wait_event(events, lambda ev: ev.kind is EventKind.FAILURE_DETECTED and 1 in (ev.get("nodes") or []), 120)
        _, err = proc.communicate(timeout=300)
    finally:
        if stopped_agent is not None:
            try:
                os.kill(stopped_agent, signal.SIGCONT)  # never leave a stopped process behind
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err  # recovered from both and completed
    # The stopped node's ranks took no part in the next generation: only their replacements did.
    second = [ev for ev in iter_events(events) if ev.kind is EventKind.RESTORE_DONE][1]
    assert not {2, 3} & set(second.get("transfer").get("continued", [])), second.get("transfer")

    out = run_ffctl(tmp_path, "report", run_id, "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    faults = rep["faults"]
    assert all(f["kind"] == "detected" for f in faults), faults  # nothing was injected
    killed, lost_node = faults  # and no third: the job never hung after the node was lost
    assert killed["cause"] == "process-exit" and killed["target"] == "rank:1"
    assert killed["measured_from"] == "reported" and killed["recovered"]
    assert lost_node["recovered"]
    assert lost_node["cause"].startswith("node-lost") and "node:1" in lost_node["target"]
    assert lost_node["measured_from"] == "last-heartbeat"
    for f in (killed, lost_node):
        assert f["lost_s"] > 0 and f["lost_gpu_hours"] > 0, f
        assert f["detection_s"] is not None and 0 <= f["detection_s"] < 10, f
    assert rep["loss_by_step"] == base.report["loss_by_step"]  # every step, bit for bit
    assert rep["lost_gpu_hours_total"] == pytest.approx(sum(f["lost_gpu_hours"] for f in faults))
    assert_nothing_left(tmp_path)
