"""A stranger on the control store's port, without the job token, against a live job.

torch's TCPStore has no authentication: anyone who reaches the controller's port can overwrite
or delete any key, including the ones that carry no seal (a queue's counter), and the server
drops the connection of a client whose `add` meets a value that is not a number. One live job
(2 nodes x 1 rank, the built-in GPT, a `kill-rank` for a recovery to attack) takes every attack
of the list below from a plain store client; the job must train on, recover from the one fault
it was given, be told of each attack (a `message_rejected` event), and commit the same loss at
every step as a fault-free run of the same seed:

- the current generation's pointer held at its old genuine value and deleted, over and over,
  from before the job starts until after the recovery;
- `hb/1` set to garbage, then held at a captured genuine heartbeat (a replay) for 3 s, three
  times the heartbeat timeout;
- `ctl/q/n` set to garbage, pushed a million below zero and ten million forward;
- agent 1's queue counter set to garbage.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from wire import control
from runs.events import EventKind
from runs.store import iter_events
from tests.helpers.launch import (
    assert_nothing_left, crashes, launch, rid, shm_left, start_launch, stop_at_end, wait_event, wait_step,
)
from tests.integration.test_attacker import _client, _controller_port

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# More than the test ever waits for: it stops the job (Ctrl-C) once the attacks are over and the
# job has trained on past them, then runs the fault-free job to the same step.
STEPS = 100_000
SEED = 11
KILL_STEP = 40
# A queue's consumer reports its counter tampered with at most once a second: the next attack
# on a counter waits that long after the last one's record.
SPACING_S = control.COUNTER_REPORT_S + 0.2
LAYOUT = ("--nnodes", "2", "--nproc-per-node", "1", "--seed", str(SEED))


class Loop:
    """Runs `attack` against the store every `period` seconds on a thread, until stopped."""

    def __init__(self, port: int, attack: Callable[[Any], None], period: float) -> None:
        self._stop = threading.Event()
        self.rounds = 0
        self.errors: list[str] = []

        def run() -> None:
            store = _client(port)
            while not self._stop.is_set():
                try:
                    attack(store)
                    self.rounds += 1
                except Exception as exc:  # the attacker keeps going; the test looks
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    store = _client(port)
                self._stop.wait(period)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def _rejected(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == EventKind.MESSAGE_REJECTED.value]


def _recorded(run_dir: Path, queue: str, text: str, node: int | None = None) -> None:
    """Wait until a `message_rejected` event on `queue` whose reason or raw value holds `text`
    (reported by agent `node`, when given) is in the record."""
    wait_event(run_dir / "events.jsonl",
               lambda ev: ev.kind is EventKind.MESSAGE_REJECTED and ev.get("queue") == queue
               and (text in str(ev.get("reason")) or text in str(ev.get("raw")))
               and (node is None or ev.get("reported_by_node") == node), timeout=60)


def test_a_stranger_on_the_store_port_neither_stops_freezes_nor_fools_the_job(tmp_path: Path) -> None:
    run_id = rid("storeattack")
    runs = tmp_path / "runs"
    run_dir = runs / run_id
    proc = start_launch(tmp_path, run_id, *LAYOUT, "--steps", str(STEPS), "--spares", "1",
                        "--inject", f"kill-rank:rank=1,step={KILL_STEP}")
    with stop_at_end(proc) as stopped:
        port = _controller_port(run_dir)
        attacker = _client(port)
        # -- the generation pointer, around a recovery -------------------------------------------
        deadline = time.monotonic() + 120
        while (old_gen := control.read(attacker, control.GEN_KEY)) is None:
            assert time.monotonic() < deadline, "generation 0 was never published"
            time.sleep(0.02)
        flip = [False]

        def pointer(store: Any) -> None:  # written back (genuine, but generation 0's), then deleted
            flip[0] = not flip[0]
            if flip[0]:
                store.set(control.GEN_KEY, old_gen)
            else:
                store.delete_key(control.GEN_KEY)

        loop = Loop(port, pointer, 0.005)
        try:
            wait_event(run_dir / "events.jsonl", lambda ev: ev.kind is EventKind.RESTORE_DONE, timeout=240)
            reached = max(int(e.get("step")) for e in iter_events(run_dir / "events.jsonl")
                          if e.kind is EventKind.STEP)
            wait_step(runs, run_id, reached + 10, timeout=120)
            # The guard reads the pointer every so often and finds it either written back or
            # deleted, whichever the attacker's last flip left: go on until it has seen both
            # (after the recovery, the written-back pointer is an old one).
            for why in ("overwritten", "deleted"):
                wait_event(run_dir / "events.jsonl", lambda ev, why=why: ev.kind is EventKind.MESSAGE_REJECTED  # type: ignore[misc]
                           and ev.get("queue") == control.GEN_KEY and why in str(ev.get("reason")), timeout=60)
        finally:
            loop.stop()
        assert loop.rounds > 50 and not loop.errors, (loop.rounds, loop.errors)

        # -- heartbeats: garbage, then a genuine beat replayed for 3 s -------------------------
        # Written again and again until the guard has read it: the agent's next beat overwrites
        # one write, and on a loaded host the guard's read may come only after that.
        garbage = Loop(port, lambda store: store.set(control.heartbeat_key(1), "garbage"), 0.01)
        try:
            _recorded(run_dir, control.heartbeat_key(1), "garbage")
        finally:
            garbage.stop()
        assert not garbage.errors, garbage.errors
        time.sleep(0.5)  # the agent's next beat is in the key again
        captured = control.read(attacker, control.heartbeat_key(1))
        assert captured is not None and b'"kind":"heartbeat"' in captured
        hold = Loop(port, lambda store: store.set(control.heartbeat_key(1), captured), 0.002)
        time.sleep(3.0)
        hold.stop()
        assert not hold.errors, hold.errors

        # -- the controller's queue counter ----------------------------------------------------
        counter = f"{control.CTL_QUEUE}/n"
        attacker.set(counter, "garbage")
        _recorded(run_dir, control.CTL_QUEUE, "garbage")
        time.sleep(SPACING_S)
        attacker.add(counter, -1_000_000)
        _recorded(run_dir, control.CTL_QUEUE, "-99")
        time.sleep(SPACING_S)
        attacker.add(counter, 10_000_000)
        _recorded(run_dir, control.CTL_QUEUE, "jumped")
        # -- agent 1's queue counter ---------------------------------------------------------------
        attacker.set(f"{control.agent_queue(1, 0)}/n", "garbage")
        _recorded(run_dir, control.agent_queue(1, 0), "not a count", node=1)

        # The job trains on, and the owner's sealed requests still get through.
        reached = max(int(e.get("step")) for e in iter_events(run_dir / "events.jsonl") if e.kind is EventKind.STEP)
        wait_step(runs, run_id, reached + 20, timeout=120)
        assert proc.poll() is None
    assert stopped.code == 130, stopped.stderr
    assert "Traceback" not in stopped.stderr, stopped.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted"  # by the test, once the attacks were over

    # The one fault it was given, recovered from; no other failure, no node lost.
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    kinds = [e["event"] for e in events]
    assert [f["kind"] for f in report["faults"]] == ["kill-rank"], report["faults"]
    assert report["faults"][0]["resumed_at"] is not None
    assert kinds.count("failure_detected") == 1 and "node_lost" not in kinds
    assert not crashes(list(iter_events(run_dir / "events.jsonl")))

    # Every attack is on record.
    rejected = _rejected(events)
    on = lambda queue, text: [e for e in rejected if e["queue"] == queue and text in e["reason"]]  # noqa: E731
    assert on(control.GEN_KEY, "overwritten") and on(control.GEN_KEY, "deleted"), rejected
    hb = control.heartbeat_key(1)
    assert [e for e in rejected if e["queue"] == hb and "garbage" in e["raw"]], rejected
    assert on(hb, "replayed") or on(hb, "written over"), rejected
    ctl_counter = [e for e in rejected if e["queue"] == control.CTL_QUEUE and "reported_by_node" not in e]
    reasons = " | ".join(f"{e['reason']} {e['raw']}" for e in ctl_counter)
    assert "not a count" in reasons and "garbage" in reasons, reasons
    assert "-99" in reasons, reasons  # the counter pushed below zero
    assert "jumped" in reasons, reasons
    agent_q = [e for e in rejected if e.get("reported_by_node") == 1 and e["queue"] == control.agent_queue(1, 0)]
    assert any("not a count" in e["reason"] for e in agent_q), rejected
    assert report["messages_rejected"] >= len(rejected)

    # The same loss at every step as a fault-free run of the same seed.
    attacked = {step: loss for step, loss in report["loss_by_step"]}
    last = max(attacked)
    assert last > KILL_STEP + 30
    clean = launch(tmp_path, rid("storeclean"), *LAYOUT, "--steps", str(last))
    assert clean.returncode == 0, clean.stderr
    baseline = {step: loss for step, loss in clean.report["loss_by_step"]}
    assert attacked == {step: baseline[step] for step in attacked}
    assert_nothing_left(tmp_path)
    assert not shm_left(run_id)


def test_queue_counters_at_the_top_of_their_range_stop_neither_the_job_nor_its_recovery(tmp_path: Path) -> None:
    # 18 nines, the largest count the counters' parser reads, written every second into the
    # controller's queue and agent 1's from before the fault until well after its recovery: once
    # it failed 3 of 4 jobs, and lost agent 1's commands (the recovery froze, unnamed).
    run_id = rid("nines")
    runs = tmp_path / "runs"
    run_dir = runs / run_id
    proc = start_launch(tmp_path, run_id, *LAYOUT, "--steps", str(STEPS), "--spares", "1",
                        "--inject", f"kill-rank:rank=1,step={KILL_STEP}")
    nines = b"9" * 18
    queues = (control.CTL_QUEUE, control.agent_queue(1, 0))
    with stop_at_end(proc) as stopped:
        loop = Loop(_controller_port(run_dir), lambda store: [store.set(f"{q}/n", nines) for q in queues], 1.0)
        try:
            wait_event(run_dir / "events.jsonl", lambda ev: ev.kind is EventKind.RESTORE_DONE, timeout=240)
            reached = max(int(e.get("step")) for e in iter_events(run_dir / "events.jsonl") if e.kind is EventKind.STEP)
            wait_step(runs, run_id, reached + 20, timeout=120)
            _recorded(run_dir, control.CTL_QUEUE, "jumped to 999999999999999999")
            _recorded(run_dir, control.agent_queue(1, 0), "jumped to 999999999999999999", node=1)
        finally:
            loop.stop()
        assert loop.rounds >= 3 and not loop.errors, (loop.rounds, loop.errors)
    assert stopped.code == 130, stopped.stderr
    report = json.loads((run_dir / "report.json").read_text())
    kinds = [json.loads(line)["event"] for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    assert [f["kind"] for f in report["faults"]] == ["kill-rank"] and report["faults"][0]["recovered"], report["faults"]
    assert kinds.count("failure_detected") == 1 and "node_lost" not in kinds
    attacked = {step: loss for step, loss in report["loss_by_step"]}
    clean = launch(tmp_path, rid("ninesclean"), *LAYOUT, "--steps", str(max(attacked)))
    assert clean.returncode == 0, clean.stderr
    assert attacked == {step: loss for step, loss in clean.report["loss_by_step"] if step in attacked}
    assert_nothing_left(tmp_path)
    assert not shm_left(run_id)
