"""The Slurm node backend's logic with fake `srun`, `scontrol`, `squeue` and `scancel` on PATH:
the node-list parser, the allocation read from the environment, the step argv, the config on the
step's stdin, spare nodes taking over a killed node, and every step stopped at the end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from fault_injectors.node import drain_argv
from fault_injectors.plan import HostCommand, Role
from ffctl.agent.config import AgentConfig
from ffctl.exits import BadInput, NoRequeue
from ffctl.backends.slurm import SlurmNodes
from ffctl.backends.slurm_cluster import (
    allocation,
    check_requeue,
    expand_nodelist,
    ffctl_drained,
    interface_of,
    is_out,
    newest_checkpoint,
    parse_node_states,
    restart_count,
    split_nodes,
)
from ffctl.backends.slurm_steps import SlurmTransport, StepKill, agent_argv
from ffctl.launch.launch_plan import requeue_bound
from ffctl.launch_spec import LaunchSpec
from runs.events import EventKind

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("n[1-3,5],m7", ["n1", "n2", "n3", "n5", "m7"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a,b[2],c-x[3-4]", ["a", "b2", "c-x3", "c-x4"]),
    (" n[1-2] , n2 ", ["n1", "n2"]),
])
def test_nodelist_parser(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-3", "n1-3]", "n[a-b]", "n[3-1]", "n[1-]"])
def test_nodelist_parser_refuses_what_it_cannot_read(text: str) -> None:
    with pytest.raises(ValueError):
        expand_nodelist(text)


def _fake(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.fixture()
def fakes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH whose Slurm commands are shell scripts that record their argv (one word a line)
    in tmp_path/calls/<tool>-<n>; srun also keeps its stdin and waits for it to close (or for
    scancel, which kills it through its pid file)."""
    bin_dir = tmp_path / "bin"
    calls = tmp_path / "calls"
    calls.mkdir()
    # Named by the time of the call (in ns): a file's mtime has the kernel's coarse tick, and two
    # calls within one tick would otherwise come back in a random order.
    record = f'f=$(mktemp "{calls}/$(basename "$0")-$(date +%s%N)-XXXXXX"); for a in "$@"; do printf "%s\\n" "$a" >> "$f"; done\n'
    _fake(bin_dir, "scontrol", record + 'case "$2" in hostnames) echo n1; echo n2; echo n3 ;; '
                                        'node) echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$3 State=DOWN+DRAIN '
                                        'Reason=Not responding [slurm@2026-01-01] Comment=(null)" ;; esac\n')
    # srun: the step's name, its stdin and its pid, then wait for EOF; a fault's command is run.
    _fake(bin_dir, "srun", record + f'''name=""; for a in "$@"; do case "$a" in --job-name=*) name="${{a#--job-name=}}" ;; esac; done
case "$name" in
  *-node*|*-spare-*) echo $$ > "{calls}/pid-$name"; cat > "{calls}/stdin-$name" ;;
  *) shift 9; "$@" ;;
esac
''')
    _fake(bin_dir, "squeue", f'for f in "{calls}"/pid-*; do [ -e "$f" ] || continue; n=$(basename "$f"); '
                             f'n=${{n#pid-}}; echo "7.$(cat "$f") $n"; done\n')
    _fake(bin_dir, "scancel", record + f'''for f in "{calls}"/pid-*; do
  [ -e "$f" ] || continue; p=$(cat "$f"); case "$2" in "7.$p") kill -9 "$p"; rm -f "$f" ;; esac
done
echo "scancel: error: Kill job error on job id 7.x: Invalid job id specified" >&2
''')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def _calls(calls: Path, tool: str) -> list[list[str]]:
    return [p.read_text().splitlines() for p in sorted(calls.glob(f"{tool}-*"))]


def test_allocation_from_scontrol_or_the_parser(fakes: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]"}
    assert allocation(env) == ("7", ["n1", "n2", "n3"])
    assert _calls(fakes, "scontrol") == [["show", "hostnames", "n[1-3]"]]
    # A host without the Slurm client: the node list is read here.
    monkeypatch.setenv("PATH", "/nonexistent")
    assert allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a[1-2],b"}) == ("7", ["a1", "a2", "b"])


def test_outside_an_allocation_is_refused_in_one_line() -> None:
    with pytest.raises(BadInput, match="not inside a Slurm allocation"):
        allocation({})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "ffctl", "launch", "--backend", "slurm", "--dry-run"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "not inside a Slurm allocation" in out.stderr


def test_extra_nodes_are_spares_and_too_few_is_bad_input() -> None:
    assert split_nodes(LaunchSpec(nnodes=2), ["n1", "n2", "n3"]) == (["n1", "n2"], ["n3"])
    with pytest.raises(BadInput, match="has 1 node"):
        split_nodes(LaunchSpec(nnodes=2), ["n1"])


def test_agent_argv_is_one_word_per_argument() -> None:
    argv = agent_argv("7", "n 2;rm", "ffctl-r-node0-1", "/opt/my python/bin/python")
    assert argv == ["srun", "--jobid=7", "--nodes=1", "--ntasks=1", "--nodelist=n 2;rm", "--overlap",
                    "--kill-on-bad-exit=1", "--cpu-bind=none", "--job-name=ffctl-r-node0-1", "--quiet",
                    "/opt/my python/bin/python", "-m", "ffctl.agent"]


def _cfg(node: int, tmp: Path) -> AgentConfig:
    return AgentConfig(run_id="r1", node=node, nnodes=2, store_host="127.0.0.1", store_port=1, address="127.0.0.1",
                       token="secret-token", log_dir=str(tmp / "logs" / str(node)), worker_argv=("-m", "x"),
                       worker_env={"GLOO_SOCKET_IFNAME": "lo"}, cwd=str(tmp))


def _wait(pred: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _nodes(tmp: Path) -> SlurmNodes:
    nodes = SlurmNodes.for_launch(LaunchSpec(nnodes=2), "r1", {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]"})
    nodes.prepare()
    nodes.log_dir = tmp / "logs"
    return nodes


def test_agents_are_steps_with_their_config_on_stdin_and_stop_when_it_closes(fakes: Path, tmp_path: Path) -> None:
    nodes = _nodes(tmp_path)
    assert [nodes.host(n) for n in range(2)] == ["n1", "n2"] and nodes.spare_hosts == ["n3"]
    steps = [nodes.start(_cfg(n, tmp_path)) for n in range(2)]
    assert _wait(lambda: all((fakes / f"stdin-ffctl-r1-node{n}-1").exists() for n in range(2)))
    # The two steps start side by side: their calls may be logged in either order.
    srun = sorted(_calls(fakes, "srun"), key=lambda c: [a for a in c if a.startswith("--nodelist=")])
    assert ["--jobid=7", "--nodes=1", "--ntasks=1", "--nodelist=n1", "--overlap"] == srun[0][:5]
    assert ["--jobid=7", "--nodes=1", "--ntasks=1", "--nodelist=n2", "--overlap"] == srun[1][:5]
    assert srun[0][-2:] == ["-m", "ffctl.agent"] and not any("secret-token" in a for c in srun for a in c)
    for s in steps:
        s.stop(timeout=10.0)
        assert s.poll() == 0
    cfg = json.loads((fakes / "stdin-ffctl-r1-node1-1").read_text())
    assert cfg["node"] == 1 and cfg["token"] == "secret-token"
    nodes.release(None)
    assert _calls(fakes, "scancel") == []  # nothing left to cancel


def test_kill_node_cancels_its_step_and_a_spare_node_takes_over(fakes: Path, tmp_path: Path) -> None:
    nodes = _nodes(tmp_path)
    steps = [nodes.start(_cfg(n, tmp_path)) for n in range(2)]
    assert _wait(lambda: (fakes / "pid-ffctl-r1-node1-1").exists())
    kill = HostCommand(1, "n2", ("kill", "-KILL", "123", "456"), None, allow_fail=True, role=Role.NODE_KILL)
    transport = nodes.transport_for(kill)
    assert isinstance(transport, StepKill)
    result = transport.run(kill.argv, timeout=10.0)
    assert result.ok and steps[1].poll() is not None
    assert _calls(fakes, "scancel")[-1][0] == "--signal=KILL"
    # Any other command runs on the node as a step of its own.
    other = nodes.transport_for(HostCommand(1, "n2", ("true",)))
    assert isinstance(other, SlurmTransport) and other.run(["true"], timeout=10.0).ok
    # The spare node's standby agent, started with the job's first agents, warms its worker
    # template from node 0's config; node 1 moving there gets it with node 1's own config.
    assert _wait(lambda: (fakes / "pid-ffctl-r1-spare-n3").exists())
    again = nodes.start(_cfg(1, tmp_path))
    assert nodes.host(1) == "n3" and nodes.failed_hosts == ["n2"] and nodes.spare_hosts == []
    assert again.name == "ffctl-r1-spare-n3" and nodes.spare_nodes() == 0
    assert _wait(lambda: len((fakes / "stdin-ffctl-r1-spare-n3").read_text().splitlines()) == 2)
    standby, real = (json.loads(line) for line in (fakes / "stdin-ffctl-r1-spare-n3").read_text().splitlines())
    assert standby["standby"] is True and standby["node"] == 0 and standby["log_dir"].endswith("spare-n3")
    assert real["standby"] is False and real["node"] == 1
    assert nodes.failed_states == {"n2": "DOWN+DRAIN (Not responding [slurm@2026-01-01])"}
    # release() cancels every step still running (a lost controller's agents do not stay).
    nodes.release(None)
    assert steps[0].poll() is not None and again.poll() is not None
    cancelled = [c[-1] for c in _calls(fakes, "scancel")]
    assert len(cancelled) == 3


def test_interface_of_reads_ip_addr_show() -> None:
    out = ("1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever\n"
           "2: eth0@if7    inet 10.1.0.5/24 brd 10.1.0.255 scope global eth0\\       valid_lft forever\n")
    assert interface_of("10.1.0.5", out) == "eth0"
    assert interface_of("127.0.0.1", out) == "lo"
    assert interface_of("10.9.9.9", out) is None


def test_the_store_listens_on_the_batch_node(fakes: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    nodes = SlurmNodes.for_launch(LaunchSpec(nnodes=2), "r1", {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]"})
    assert nodes.prepare() == "127.0.0.1"
    assert [nodes.address(n) for n in range(2)] == ["127.0.0.1"] * 2 and nodes.interface(1) == "lo"
    assert ["show", "node", "n1", "--oneliner"] in _calls(fakes, "scontrol")


def test_dry_run_inside_an_allocation_names_the_slurm_nodes(fakes: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n[1-3]", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "ffctl", "launch", "--backend", "slurm", "--nnodes", "2",
                          "--runs-dir", str(tmp_path / "runs"), "--inject", "kill-node:node=1,step=5", "--dry-run"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "on Slurm node n1" in out.stdout and "on Slurm node n2" in out.stdout
    assert "scancel --signal=KILL" in " ".join(out.stdout.split())
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_slurm_tests_say_why_they_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers import slurm as harness

    monkeypatch.setattr(harness.os, "geteuid", lambda: 1000)
    assert harness.skip_reason() is not None and harness.skip_reason().startswith("needs root")  # type: ignore[union-attr]
    monkeypatch.setattr(harness.os, "geteuid", lambda: 0)
    monkeypatch.setattr(harness, "_which", lambda tool: None if tool == "slurmd" else f"/usr/bin/{tool}")
    assert harness.skip_reason() == ("Slurm not installed (missing slurmd): apt-get install slurmctld slurmd "
                                     "slurm-client munge (scripts/setup does as root)")


SINFO = """n1|mixed|none
n2|drained|ffctl:r1:f1
n2|drained|ffctl:r1:f1
n3|down*|Not responding
n4|mixed+drain|admin check
n5|idle|none
n6|draining|ffctl:r2:f4
garbage line
"""


def test_sinfo_node_states_are_read_and_out_of_use_states_told_apart() -> None:
    states = parse_node_states(SINFO)
    assert states == {"n1": ("mixed", ""), "n2": ("drained", "ffctl:r1:f1"), "n3": ("down*", "Not responding"),
                      "n4": ("mixed+drain", "admin check"), "n5": ("idle", ""), "n6": ("draining", "ffctl:r2:f4")}
    assert [n for n, (s, _) in states.items() if is_out(s)] == ["n2", "n3", "n4", "n6"]
    assert not is_out("allocated") and is_out("FAIL") and is_out("DOWN+DRAIN") and is_out("idle+drain")
    # What `ffctl inject revert --all` resumes: ffctl's drains only, all runs' or one run's.
    assert ffctl_drained(states) == ["n2", "n6"] and ffctl_drained(states, "r1") == ["n2"]
    assert ffctl_drained({"n2": ("idle", "ffctl:r1:f1")}) == []  # resumed already


class _Record:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[tuple[EventKind, dict[str, object]]] = []

    def append(self, kind: EventKind, /, t: float | None = None, **data: object) -> None:
        self.events.append((kind, data))

    def update_run_info(self, **fields: object) -> None:
        self.info = fields


def test_a_node_slurm_drains_is_a_node_fault_its_agent_leaves(fakes: Path, tmp_path: Path) -> None:
    nodes = _nodes(tmp_path)
    record = _Record(tmp_path)
    nodes._record = record  # type: ignore[assignment]
    steps = [nodes.start(_cfg(n, tmp_path)) for n in range(2)]
    assert _wait(lambda: (fakes / "pid-ffctl-r1-node1-1").exists())
    nodes.check_nodes({"n1": ("mixed", ""), "n2": ("mixed+drain", "bad dimm"), "n3": ("idle", "")})
    assert record.events == [(EventKind.NODE_STATE, {"node": 1, "host": "n2", "state": "mixed+drain",
                                                     "reason": "bad dimm", "by": "scheduler"})]
    # Its step was ended (a drain leaves steps running), so node 1 comes back on the spare node.
    assert steps[1].poll() is not None and steps[0].poll() is None
    nodes.check_nodes({"n2": ("drained", "bad dimm")})
    assert len(record.events) == 1  # said once
    nodes.start(_cfg(1, tmp_path))
    assert nodes.host(1) == "n3"
    assert record.info["slurm"]["out_of_use"] == {"n2": "mixed+drain (bad dimm)"}  # type: ignore[index]
    nodes.release(None)


def test_a_drain_of_ours_runs_here_is_not_news_and_is_resumed_at_the_end(fakes: Path, tmp_path: Path) -> None:
    nodes = _nodes(tmp_path)
    drain = HostCommand(1, "n2", drain_argv("n2", "ffctl:r1:f1"), role=Role.NODE_DRAIN, about="ffctl:r1:f1")
    transport = nodes.transport_for(drain)
    assert not isinstance(transport, SlurmTransport) and transport.run(drain.argv, timeout=10.0).ok
    record = _Record(tmp_path)
    nodes._record = record  # type: ignore[assignment]
    nodes.check_nodes({"n2": ("drained", "ffctl:r1:f1")})
    assert record.events == [] and nodes.drained == {"n2": "ffctl:r1:f1"}
    nodes.release(None)
    assert _calls(fakes, "scontrol")[-1] == ["update", "nodename=n2", "state=resume"]
    assert nodes.resumed == ["n2"]


def test_a_spare_node_slurm_takes_out_is_no_longer_a_spare(fakes: Path, tmp_path: Path) -> None:
    nodes = _nodes(tmp_path)
    nodes.check_nodes({"n3": ("down*", "Not responding")})
    assert nodes.spare_hosts == [] and nodes.spare_nodes() == 0 and nodes.out_nodes == {"n3": "down* (Not responding)"}
    nodes.release(None)


def test_kill_node_drain_option_is_checked_and_planned_after_the_kill() -> None:
    from fault_injectors.node import plan as node_plan
    from fault_injectors.plan import NodePlace, Topology
    from wire.fault_spec import FaultSpecError, parse_injection

    spec = parse_injection("kill-node:node=1,step=5,drain=yes", scheduled=True)
    topo = Topology("r1", (NodePlace(0, "n1", "10.0.0.1", 11), NodePlace(1, "n2", "10.0.0.2", 12)), ())
    plan = node_plan(replace(spec, fault_id="f1"), topo, (), (1,))
    assert [c.argv[0] for c in plan.apply] == ["kill", "scontrol"]
    assert plan.apply[1].argv == ("scontrol", "update", "nodename=n2", "state=drain", "reason=ffctl:r1:f1")
    with pytest.raises(FaultSpecError, match="drain='maybe' is not yes or no"):
        parse_injection("kill-node:node=1,step=5,drain=maybe", scheduled=True)
    with pytest.raises(FaultSpecError, match="drain"):
        parse_injection("kill-rank:rank=1,step=5,drain=yes", scheduled=True)


def test_a_drain_outside_slurm_is_refused_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ffctl", "launch", "--dry-run", "--runs-dir", str(tmp_path),
                          "--inject", "kill-node:node=1,step=5,drain=yes"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "ffctl: error: --inject kill-node node:1 @step=5: drain=yes drains a Slurm node; it needs --backend slurm"], out.stderr


def test_a_node_down_seen_after_its_node_moved_is_recorded_for_that_node(fakes: Path, tmp_path: Path) -> None:
    # Slurm's DOWN ended the step, and the node moved to the spare before the next poll.
    nodes = _nodes(tmp_path)
    record = _Record(tmp_path)
    nodes._record = record  # type: ignore[assignment]
    steps = [nodes.start(_cfg(n, tmp_path)) for n in range(2)]
    assert _wait(lambda: (fakes / "pid-ffctl-r1-node1-1").exists())
    steps[1].cancel("KILL", 10.0)
    nodes.start(_cfg(1, tmp_path))
    nodes.check_nodes({"n2": ("down*", "Not responding"), "n9": ("down", "not ours")})
    assert [(k, d["node"], d["host"]) for k, d in record.events] == [(EventKind.NODE_STATE, 1, "n2")]
    nodes.release(None)


def test_requeues_are_counted_and_bounded() -> None:
    assert restart_count({}) == 0 and restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert restart_count({"SLURM_RESTART_COUNT": "x"}) == 0
    check_requeue(3, 3)  # the third requeue of a job allowed 3 starts
    with pytest.raises(NoRequeue, match="requeued 4 time"):
        check_requeue(4, 3)
    assert requeue_bound(LaunchSpec(max_restarts=1)) == 1 and requeue_bound(LaunchSpec()) == 3


def _run_with_checkpoints(runs: Path, run_id: str, job: str, steps: dict[int, bool]) -> None:
    """A run directory of Slurm job `job` holding checkpoints of `steps` (True: complete)."""
    (runs / run_id / "checkpoints").mkdir(parents=True)
    (runs / run_id / "run.json").write_text(json.dumps({"slurm": {"job_id": job}}))
    for step, complete in steps.items():
        d = runs / run_id / "checkpoints" / f"step-{step:08d}"
        d.mkdir()
        (d / "rank-0.snap").write_bytes(b"x")
        if complete:
            (d / "COMPLETE").touch()


def test_a_requeued_job_finds_the_newest_complete_checkpoint_of_its_earlier_runs(tmp_path: Path) -> None:
    _run_with_checkpoints(tmp_path, "slurm-7", "7", {10: True, 20: True, 30: False})  # 30: a rank never finished
    _run_with_checkpoints(tmp_path, "slurm-7-r1", "7", {15: True})
    _run_with_checkpoints(tmp_path, "slurm-8", "8", {40: True})  # another job's
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "run.json").write_text("{")
    found = newest_checkpoint(tmp_path, "7", exclude="slurm-7-r2")
    assert found == ("slurm-7", 20, tmp_path / "slurm-7" / "checkpoints" / "step-00000020")
    assert newest_checkpoint(tmp_path, "9") is None
    assert newest_checkpoint(tmp_path, "7", exclude="slurm-7") == ("slurm-7-r1", 15,
                                                                   tmp_path / "slurm-7-r1" / "checkpoints" / "step-00000015")


def test_a_job_requeued_past_max_restarts_starts_nothing_and_exits_4(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_RESTART_COUNT": "2"}
    out = subprocess.run([sys.executable, "-m", "ffctl", "launch", "--backend", "slurm", "--nnodes", "2",
                          "--max-restarts", "1", "--runs-dir", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 4, out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1] == ("ffctl: the Slurm job was requeued 2 time(s), more than "
                                                   "--max-restarts 1: not starting (exit 4: do not requeue)")
    assert list(tmp_path.iterdir()) == []  # no run record


def test_a_standby_agent_never_needed_stops_its_template_and_exits(tmp_path: Path) -> None:
    # A spare node's standby agent warms a worker template, then waits for a node's config; the
    # run ending first (its stdin closes) ends it and its template (no process outlives the test).
    cfg = replace(_cfg(0, tmp_path), standby=True, python=sys.executable)
    proc = subprocess.Popen([sys.executable, "-m", "ffctl.agent"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdin is not None
    proc.stdin.write((cfg.to_json() + "\n").encode())
    proc.stdin.flush()
    assert _wait(lambda: (tmp_path / "logs" / "0" / "template.log").exists(), 60)
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
