"""The host template end to end: a local launch's agents, and a node back after `kill-node`, are
forked warm from one process that imported torch once, and nothing of it outlives the run."""
from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from runs.events import EventKind
from runs.store import iter_events
from tests.helpers.launch import (
    assert_nothing_left, launch, rid, run_ffctl, shm_left, start_launch, stop_at_end, wait_event, wait_step,
)

# Whole jobs launched, one with a node killed and started again: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HOST_TEMPLATE = "ffctl.agent.host_template"
COLD_TEMPLATE = "ffctl.agent.template"


def _cmd(proc: psutil.Process) -> str:
    # A child listed a moment ago may have exited since (a worker the agent just replaced): gone,
    # it is no template of either kind.
    try:
        return " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _forked_warm(agent_pid: int, host: psutil.Process) -> None:
    """`agent_pid` is the host template's child, and its worker template is the agent's fork
    (the host template's command line, not a fresh `python -m ffctl.agent.template`)."""
    agent = psutil.Process(agent_pid)
    assert agent.ppid() == host.pid
    templates = [c for c in agent.children() if HOST_TEMPLATE in _cmd(c)]
    assert templates, [_cmd(c) for c in agent.children()]
    assert not [c for c in agent.children(recursive=True) if COLD_TEMPLATE in _cmd(c).split()]


def test_agents_and_a_node_back_after_kill_node_are_forked_warm(tmp_path: Path) -> None:
    run_id = rid("hosttpl")
    events = tmp_path / "runs" / run_id / "events.jsonl"
    proc = start_launch(tmp_path, run_id, "--nnodes", "2", "--nproc-per-node", "1", "--steps", "100000",
                        "--spares", "1")
    with stop_at_end(proc) as stopped:
        wait_step(tmp_path / "runs", run_id, 2)
        first = [ev for ev in iter_events(events) if ev.kind is EventKind.AGENT_STARTED]
        assert sorted(ev.get("node") for ev in first) == [0, 1]
        host = psutil.Process(psutil.Process(int(first[0].get("pid"))).ppid())
        assert HOST_TEMPLATE in _cmd(host) and host.ppid() == proc.pid
        for ev in first:
            _forked_warm(int(ev.get("pid")), host)

        # Node 1 killed once its first agent is looked at (a fault scheduled at a step raced the
        # look on a fast host): its agent SIGKILLed, then its workers. The node that comes back
        # is forked from the same host template, its worker template warm at once.
        killed = run_ffctl(tmp_path, "inject", "kill-node", "--run", run_id, "--node", "1", timeout=60)
        assert killed.returncode == 0, killed.stderr
        back = wait_event(events, lambda ev: ev.kind is EventKind.AGENT_STARTED and ev.get("node") == 1
                          and int(ev.get("pid")) != int(next(e for e in first if e.get("node") == 1).get("pid")))
        restored = wait_event(events, lambda ev: ev.kind is EventKind.RESTORE_DONE and int(ev.get("gen")) >= 1)
        _forked_warm(int(back.get("pid")), host)
        wait_step(tmp_path / "runs", run_id, int(restored.get("step")) + 10)
        assert psutil.Process(host.pid).is_running()
    assert stopped.code == 130, stopped.stderr  # Ctrl-C
    # The host template ends with the run, after the agents it served.
    assert not psutil.pid_exists(host.pid) or psutil.Process(host.pid).status() == psutil.STATUS_ZOMBIE
    assert_nothing_left(tmp_path)
    assert shm_left(run_id) == []


def test_the_host_template_can_be_switched_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # FFCTL_HOST_TEMPLATE=0: every agent a fresh `python -m ffctl.agent`, its worker template a
    # fresh interpreter too, as before the host template.
    monkeypatch.setenv("FFCTL_HOST_TEMPLATE", "0")
    run_id = rid("nohosttpl")
    events = tmp_path / "runs" / run_id / "events.jsonl"
    proc = start_launch(tmp_path, run_id, "--nnodes", "2", "--nproc-per-node", "1", "--steps", "100000")
    with stop_at_end(proc) as stopped:
        wait_step(tmp_path / "runs", run_id, 2)
        for ev in iter_events(events):
            if ev.kind is EventKind.AGENT_STARTED:
                agent = psutil.Process(int(ev.get("pid")))
                assert agent.ppid() == proc.pid and _cmd(agent).endswith("-m ffctl.agent")
                assert [c for c in agent.children() if COLD_TEMPLATE in _cmd(c).split()]
    assert stopped.code == 130, stopped.stderr
    assert_nothing_left(tmp_path)


# When the script's globals are freed tells whether the worker ends as an interpreter does (see
# tests/integration/test_worker_exit.py, which checks the same of a template started cold).
ORDER = """
import atexit, sys

class Held:
    def __del__(self):
        sys.stdout.write("freed\\n")

held = Held()
atexit.register(lambda: sys.stdout.write("atexit\\n"))
buffered = open(sys.argv[1], "w")
buffered.write("flushed at exit\\n")  # never closed: only the interpreter's end writes it out
print("ran")
"""


def test_a_worker_forked_through_the_host_template_ends_as_python_script_ends(tmp_path: Path) -> None:
    # A worker three forks from the host template (it, then the agent, then the agent's worker
    # template) ends as `python script.py` ends: atexit handlers, then its globals freed, then
    # buffered files flushed.
    script = tmp_path / "order.py"
    script.write_text(ORDER)
    out = tmp_path / "out.txt"
    res = launch(tmp_path, rid("order"), "--nnodes", "1", "--nproc-per-node", "1", str(script), str(out))
    assert res.returncode == 0, res.stderr
    log = (tmp_path / "runs" / str(res.run_id) / "logs" / "0" / "0.log").read_text().splitlines()
    assert log == ["ran", "atexit", "freed"]
    assert out.read_text() == "flushed at exit\n"
    assert_nothing_left(tmp_path)
