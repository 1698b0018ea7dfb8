"""Multi-host pieces that need no SSH server: hostfile to nodes, reading the hosts' network probe,
the store's address, the agent config a host gets, and fault commands routed to their host."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest

from fault_injectors.plan import HostCommand
from fault_injectors.transport import CommandResult, LocalTransport, TransportError
from ffctl.agent.config import CONFIG_ENV, AgentConfig
from ffctl.exits import BadInput, InfraError
from ffctl.hosts.hostfile import HostEntry
from ffctl.backends.ssh import MAKE_RUN_DIR, SSHNodes
from ffctl.hosts.ssh import preflight as ssh_preflight
from ffctl.hosts.ssh.preflight import HostSetup, check_master_addr, controller_address, hosts_spec, parse_net_probe
from ffctl.launch_spec import LaunchSpec

PROBE = """conn=10.0.0.1 51234 10.0.0.11 22
1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever
1: lo    inet6 ::1/128 scope host \\       valid_lft forever preferred_lft forever
7: eth1@if8    inet 10.0.0.11/24 scope global eth1\\       valid_lft forever preferred_lft forever
9: ib0    inet 192.168.5.11/24 scope global ib0\\       valid_lft forever preferred_lft forever
"""


def spec(tmp_path: Path, hostfile: str, **kw: Any) -> LaunchSpec:
    path = tmp_path / "hosts"
    path.write_text(hostfile)
    return LaunchSpec(hostfile=path, **kw)


# -- hostfile to nodes ------------------------------------------------------------------------


def test_one_node_per_host_with_its_slots(tmp_path: Path) -> None:
    got, entries = hosts_spec(spec(tmp_path, "a slots=3\nb slots=3\nc slots=3\n", nnodes=7, nproc_per_node=1))
    assert (got.nnodes, got.nproc_per_node) == (3, 3)
    assert [e.name for e in entries] == ["a", "b", "c"]


def test_hosts_without_slots_take_nproc_per_node(tmp_path: Path) -> None:
    got, _ = hosts_spec(spec(tmp_path, "a\nb slots=4\n", nproc_per_node=4))
    assert (got.nnodes, got.nproc_per_node) == (2, 4)


def test_unequal_slots_are_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"unequal slots \(a 2, b:2222 4\)"):
        hosts_spec(spec(tmp_path, "a slots=2\nb:2222 slots=4\n"))


def test_bad_hostfile_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"hosts:2: bad slots 'x'"):
        hosts_spec(spec(tmp_path, "a\nb slots=x\n"))


# -- what a host says about its network ----------------------------------------------------------


def test_address_interface_and_controller_from_the_probe() -> None:
    assert parse_net_probe("n1", PROBE) == ("10.0.0.11", "eth1", "10.0.0.1")


def test_ipv4_mapped_addresses_are_plain() -> None:
    probe = PROBE.replace("conn=10.0.0.1 51234 10.0.0.11 22", "conn=::ffff:10.0.0.1 5 ::ffff:10.0.0.11 22")
    assert parse_net_probe("n1", probe) == ("10.0.0.11", "eth1", "10.0.0.1")


def test_an_address_on_no_interface_is_refused() -> None:
    probe = PROBE.replace("10.0.0.11 22", "172.16.0.9 2222")
    with pytest.raises(InfraError, match=r"^n1: the address SSH reached \(172.16.0.9\) is on none"):
        parse_net_probe("n1", probe)


def test_no_ssh_connection_variable() -> None:
    with pytest.raises(InfraError, match="^n1: cannot tell which address"):
        parse_net_probe("n1", PROBE.replace("conn=10.0.0.1 51234 10.0.0.11 22", "conn="))


# -- the store's address ---------------------------------------------------------------------


def setup(node: int = 0, address: str = "127.0.0.1", seen: str = "127.0.0.1", offset: float | None = 0.25) -> HostSetup:
    return HostSetup(node, HostEntry(f"n{node}"), "/usr/bin/python3", "0.1.0", address, "lo", seen, offset, 0.01)


def test_master_addr_is_checked() -> None:
    assert check_master_addr("127.0.0.1") == "127.0.0.1"
    for bad, why in (("0.0.0.0", "not an address of this machine"), ("192.0.2.9", "not an address of this machine"),
                     ("node7", "not an IP address")):
        with pytest.raises(BadInput, match=f"^--master-addr {bad}: {why}$"):
            check_master_addr(bad)


def test_the_address_the_first_host_saw() -> None:
    assert controller_address([setup()]) == "127.0.0.1"
    assert controller_address([setup()], "127.0.0.1") == "127.0.0.1"


def test_a_host_reached_over_loopback_cannot_join_other_hosts() -> None:
    with pytest.raises(BadInput, match=r"^n0: reached over loopback \(127.0.0.1\)"):
        controller_address([setup(0), setup(1, address="10.0.0.11", seen="10.0.0.1")])


def test_hosts_and_the_sandbox_do_not_mix(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="^--sandbox netns and --hosts"):
        hosts_spec(spec(tmp_path, "a\n", sandbox="netns"))


def test_an_address_seen_through_nat_falls_back_to_our_route(monkeypatch: pytest.MonkeyPatch) -> None:
    # The host saw an address that is not ours (NAT): our source address towards it is used.
    monkeypatch.setattr(ssh_preflight, "_route_source", lambda dest: "127.0.0.1" if dest == "192.0.2.10" else None)
    assert controller_address([setup(address="192.0.2.10", seen="192.0.2.1")]) == "127.0.0.1"
    monkeypatch.setattr(ssh_preflight, "_route_source", lambda dest: None)
    with pytest.raises(InfraError, match=r"^n0: cannot tell .* give --master-addr$"):
        controller_address([setup(address="192.0.2.10", seen="192.0.2.1")])


# -- the launcher, with stand-in transports --------------------------------------------------------


@dataclass
class FakeProcess:
    host: str
    remote_pid: int = 4242
    output_closed: bool = True
    terminated: bool = False

    def read_line(self, timeout: float) -> None:
        return None

    def poll(self) -> int | None:
        return 0 if self.terminated else None

    def terminate(self, timeout: float = 10.0) -> int | None:
        self.terminated = True
        return 0

    def close(self) -> None:
        pass


@dataclass
class FakeTransport:
    host: str
    runs: list[tuple[str, ...]] = field(default_factory=list)
    started: list[tuple[tuple[str, ...], dict[str, str], str | None]] = field(default_factory=list)
    fail: bool = False

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        if self.fail:
            raise TransportError(f"{self.host}: connection lost")
        self.runs.append(tuple(argv))
        return CommandResult(tuple(argv), 0, "", "")

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        if self.fail:
            raise TransportError(f"{self.host}: connection lost")

    def start(self, argv: Sequence[str], env: Mapping[str, str] | None = None, *, cwd: str | None = None,
              grace_s: float = 5.0, timeout: float = 30.0) -> FakeProcess:
        self.started.append((tuple(argv), dict(env or {}), cwd))
        return FakeProcess(self.host)

    def close(self) -> None:
        pass


def nodes(tmp_path: Path) -> tuple[SSHNodes, list[FakeTransport]]:
    fakes = [FakeTransport("n0"), FakeTransport("n1")]
    hosts = [(fakes[0], setup(0, "10.0.0.10", "10.0.0.1")), (fakes[1], setup(1, "10.0.0.11", "10.0.0.1", None))]
    return SSHNodes(hosts, "run1", tmp_path / "logs", "/scratch/ffctl"), fakes  # type: ignore[arg-type]


def test_placement_comes_from_the_host_checks(tmp_path: Path) -> None:
    launcher, _ = nodes(tmp_path)
    assert [launcher.host(n) for n in (0, 1)] == ["n0", "n1"]
    assert [launcher.address(n) for n in (0, 1)] == ["10.0.0.10", "10.0.0.11"]
    assert launcher.interface(1) == "lo" and launcher.netns(1) is None
    assert launcher.clock_offset(0) == 0.25 and launcher.clock_offset(1) is None
    assert launcher.run_dir == "/scratch/ffctl/run1"


def test_the_agent_config_goes_in_the_channel_environment(tmp_path: Path) -> None:
    launcher, fakes = nodes(tmp_path)
    cfg = AgentConfig(run_id="run1", node=1, nnodes=2, store_host="10.0.0.1", store_port=29500,
                      address="10.0.0.11", token="s3cret", log_dir=str(tmp_path / "logs" / "1"),
                      worker_argv=("train.py", "--x"), cwd="/home/me/proj", python="/local/python")
    proc = launcher.start(cfg)
    assert proc.pid == 4242
    # The run's directory made private, in a runs root of ours no other user can write to.
    assert fakes[1].runs == [("sh", "-c", MAKE_RUN_DIR, "sh", "/scratch/ffctl", "/scratch/ffctl/run1",
                              "/scratch/ffctl/run1/logs/1")]
    (argv, env, cwd), = fakes[1].started
    assert argv == ("/usr/bin/python3", "-m", "ffctl.agent")
    assert "s3cret" not in " ".join(argv)  # the token never reaches a command line
    remote = AgentConfig.from_json(env[CONFIG_ENV])
    assert remote.token == "s3cret" and cwd == "/scratch/ffctl/run1"
    assert remote.log_dir == "/scratch/ffctl/run1/logs/1" and remote.cwd == "/scratch/ffctl/run1"
    assert remote.python == "/usr/bin/python3"
    assert remote.worker_argv == ("/home/me/proj/train.py", "--x")  # same path on every host
    assert json.loads(env[CONFIG_ENV])["store_host"] == "10.0.0.1"
    proc.stop(1.0)
    assert (tmp_path / "logs" / "agent-1.log").exists()


def test_fault_commands_reach_their_host_and_fail_as_values(tmp_path: Path) -> None:
    launcher, fakes = nodes(tmp_path)
    cmd = HostCommand(1, "n1", ("kill", "-KILL", "7"))
    assert launcher.transport_for(cmd).run(cmd.argv, timeout=5).ok
    assert fakes[1].runs[-1] == ("kill", "-KILL", "7") and fakes[0].runs == []
    fakes[1].fail = True
    result = launcher.transport_for(cmd).run(cmd.argv, timeout=5)
    assert result.returncode == 255 and "connection lost" in result.stderr
    with pytest.raises(OSError, match="n1: connection lost"):
        launcher.transport_for(cmd).spawn_detached(["sleep", "1"], timeout=5)
    assert isinstance(launcher.transport_for(HostCommand(0, "localhost", ("true",))), LocalTransport)


def test_remote_runs_dir_must_be_absolute(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="must be an absolute path"):
        SSHNodes([], "run1", tmp_path, "ffctl-runs")
