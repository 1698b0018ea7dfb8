"""SSHTransport against real sshd servers in network namespaces (see tests/helpers/sshd.py)."""
from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path
from typing import Iterator

import pytest

from fault_injectors.transport import CommandResult, Transport, TransportError
from ffctl.hosts.hostfile import HostEntry
from ffctl.hosts.ssh.remote import (
    AuthFailed,
    HostKeyChanged,
    HostKeyUnknown,
    HostUnreachable,
    RemoteCommandMissing,
    SSHError,
    SSHTransport,
    Stream,
    require_command,
    resolve_settings,
)
from tests.conftest import needs_root
from tests.helpers.sshd import SSHCluster, checked_sshd_cluster, empty_known_hosts, generate_ed25519
from tests.helpers.sshd import no_ssh_agent  # noqa: F401 - autouse fixture

pytestmark = [pytest.mark.root, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SSHCluster]:
    with checked_sshd_cluster(2) as c:
        yield c


@pytest.fixture
def node0(cluster: SSHCluster) -> Iterator[SSHTransport]:
    transport = SSHTransport(HostEntry("node0"), ssh_config=cluster.ssh_config, connect_timeout=5)
    yield transport
    transport.close()


def _pgrep(cluster: SSHCluster, token: str) -> list[str]:
    """Live processes on node0 whose command line contains token (zombies have none)."""
    proc = cluster.netns_run(cluster.hosts[0], ["pgrep", "-af", token])
    return proc.stdout.splitlines()


def _group_alive(pgid: int) -> list[str]:
    """Non-zombie processes in a process group (the PID namespace is shared with the hosts)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        state, _ppid, pgrp = text.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            alive.append(text.split(" ", 1)[0])
    return alive


def _eventually(check: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return bool(check())  # type: ignore[operator]


# -- running commands ---------------------------------------------------------------------------


@needs_root
def test_is_a_transport(node0: SSHTransport) -> None:
    assert isinstance(node0, Transport)
    assert node0.host == "node0"


@needs_root
def test_run_returns_output_and_exit_code(node0: SSHTransport, cluster: SSHCluster) -> None:
    result = node0.run(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=10)
    assert result == CommandResult(("sh", "-c", "echo out; echo err >&2; exit 3"), 3, "out\n", "err\n")
    assert not result.ok

    # it really ran inside node0's namespace
    addrs = node0.run(["ip", "-o", "-4", "addr", "show"], timeout=10)
    assert cluster.hosts[0].address in addrs.stdout
    assert cluster.hosts[1].address not in addrs.stdout


@needs_root
def test_non_zero_exit_is_a_value(node0: SSHTransport) -> None:
    assert node0.run(["false"], timeout=10).returncode == 1
    missing = node0.run(["ffctl-no-such-command"], timeout=10)
    assert missing.returncode == 127


@needs_root
def test_input_is_sent_and_stdin_closed(node0: SSHTransport) -> None:
    assert node0.run(["cat"], timeout=10, input="line 1\nline 2\n").stdout == "line 1\nline 2\n"
    # without input the command sees EOF at once instead of hanging
    assert node0.run(["cat"], timeout=10).stdout == ""


@needs_root
def test_large_output_on_both_streams(node0: SSHTransport) -> None:
    script = "head -c 3000000 /dev/zero | tr '\\0' a; head -c 2000000 /dev/zero | tr '\\0' b >&2"
    result = node0.run(["sh", "-c", script], timeout=30)
    assert len(result.stdout) == 3_000_000 and len(result.stderr) == 2_000_000


@needs_root
def test_run_timeout_is_a_value_and_stops_the_command(node0: SSHTransport, cluster: SSHCluster) -> None:
    token = f"ffctl-slow-{secrets.token_hex(4)}"
    started = time.monotonic()
    result = node0.run(["sh", "-c", "sleep 30", token], timeout=0.5)
    assert result.returncode == 124
    assert "timed out" in result.stderr
    assert time.monotonic() - started < 5
    assert _eventually(lambda: _pgrep(cluster, token) == [], timeout=10)


@needs_root
def test_argv_words_arrive_verbatim(node0: SSHTransport, cluster: SSHCluster) -> None:
    marker = cluster.workdir / f"injected-{secrets.token_hex(4)}"
    words = [
        f"'; touch {marker} #",
        f"$(touch {marker})",
        f"`touch {marker}`",
        f"; touch {marker}",
        f"&& touch {marker}",
        f"| touch {marker}",
        f"\"; touch {marker}; echo \"",
        "two  spaces and\ttab",
        "it's",
        '"double"',
        "back\\slash",
        "*",
        "~",
        "$HOME",
        "${HOME}",
        "",
        "new\nline",
        "-n",
    ]
    result = node0.run(["printf", "%s\\0", *words], timeout=10)
    assert result.ok, result.describe()
    assert result.stdout.split("\0")[:-1] == words
    assert not marker.exists()


@needs_root
def test_require_command(node0: SSHTransport) -> None:
    assert require_command(node0, ["true"], timeout=10).ok
    with pytest.raises(RemoteCommandMissing) as info:
        require_command(node0, ["ffctl-no-such-command", "--version"], timeout=10, what="ffctl")
    assert str(info.value).startswith("node0: ffctl is not installed")
    assert isinstance(info.value, TransportError)


# -- host keys ------------------------------------------------------------------------------------


@needs_root
def test_unknown_host_key_is_refused(cluster: SSHCluster, tmp_path: Path) -> None:
    known = empty_known_hosts(tmp_path)
    transport = SSHTransport(HostEntry("node0"), ssh_config=cluster.ssh_config, known_hosts=known)
    with pytest.raises(HostKeyUnknown) as info:
        transport.connect()
    message = str(info.value)
    assert message.startswith(f"node0 ({cluster.hosts[0].address}:22): unknown host key")
    assert "--accept-new-host-keys" in message
    assert "SHA256:" in message
    assert "\n" not in message
    assert known.read_text() == ""
    assert not transport.connected


@needs_root
def test_unknown_host_key_accepted_when_asked_and_saved(cluster: SSHCluster, tmp_path: Path) -> None:
    known = tmp_path / "sub" / "known_hosts"  # a missing file (and folder) is created
    host = cluster.hosts[1]
    with SSHTransport(
        HostEntry("node1"), ssh_config=cluster.ssh_config, known_hosts=known, accept_new_host_keys=True
    ) as transport:
        assert transport.run(["true"], timeout=10).ok
    assert known.read_text() == f"{host.address} {host.host_public_key}\n"
    assert known.stat().st_mode & 0o777 == 0o600

    # from now on the key is known: no flag needed
    with SSHTransport(HostEntry("node1"), ssh_config=cluster.ssh_config, known_hosts=known) as again:
        assert again.run(["true"], timeout=10).ok
    assert known.read_text().count("\n") == 1


@needs_root
def test_accepting_appends_and_keeps_existing_lines(cluster: SSHCluster, tmp_path: Path) -> None:
    other = generate_ed25519(tmp_path / "other")
    known = tmp_path / "known_hosts"
    # a line paramiko cannot parse must not stop the others from being read or kept
    known.write_text(f"# my comment\nbroken.example ssh-ed25519 AAAAnot-base64\nother.example {other}")
    with SSHTransport(
        HostEntry("node0"), ssh_config=cluster.ssh_config, known_hosts=known, accept_new_host_keys=True
    ) as transport:
        transport.connect()
    lines = known.read_text().splitlines()
    assert lines[:3] == ["# my comment", "broken.example ssh-ed25519 AAAAnot-base64", f"other.example {other}"]
    assert lines[3] == f"{cluster.hosts[0].address} {cluster.hosts[0].host_public_key}"


@needs_root
@pytest.mark.parametrize("accept_new", [False, True])
def test_changed_host_key_is_always_refused(cluster: SSHCluster, tmp_path: Path, accept_new: bool) -> None:
    other = generate_ed25519(tmp_path / "impostor")
    known = tmp_path / "known_hosts"
    known.write_text(f"{cluster.hosts[0].address} {other}\n")
    transport = SSHTransport(
        HostEntry("node0"), ssh_config=cluster.ssh_config, known_hosts=known,
        accept_new_host_keys=accept_new,
    )
    with pytest.raises(HostKeyChanged) as info:
        transport.run(["true"], timeout=10)
    message = str(info.value)
    assert message.startswith(f"node0 ({cluster.hosts[0].address}:22): HOST KEY CHANGED")
    assert "\n" not in message
    assert known.read_text() == f"{cluster.hosts[0].address} {other}\n"


# -- reachability and authentication -------------------------------------------------------------


@needs_root
def test_port_with_nothing_listening_is_unreachable(cluster: SSHCluster) -> None:
    address = cluster.hosts[0].address
    transport = SSHTransport(HostEntry(address, user="root", port=2222), ssh_config=cluster.ssh_config)
    started = time.monotonic()
    with pytest.raises(HostUnreachable) as info:
        transport.run(["true"], timeout=10)
    assert time.monotonic() - started < 3
    assert str(info.value) == f"{address} ({address}:2222): connection refused on {address}:2222 (is sshd running?)"


@needs_root
def test_address_with_no_host_is_unreachable_quickly(cluster: SSHCluster) -> None:
    address = cluster.unused_address
    transport = SSHTransport(
        HostEntry(address, user="root"), ssh_config=cluster.ssh_config, connect_timeout=1.5
    )
    started = time.monotonic()
    with pytest.raises(HostUnreachable) as info:
        transport.connect()
    assert time.monotonic() - started < 5
    assert str(info.value).startswith(f"{address}: ")


def test_unresolvable_name_is_unreachable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # No real DNS query: the resolver's answer is simulated.
    def fail(*args: object, **kwargs: object) -> socket.socket:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", fail)
    transport = SSHTransport(HostEntry("no-such-host"), ssh_config=tmp_path / "none")
    with pytest.raises(HostUnreachable, match=r"^no-such-host: cannot resolve 'no-such-host'"):
        transport.connect()


@needs_root
def test_wrong_user_key_fails_authentication(cluster: SSHCluster, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong_key"
    generate_ed25519(wrong)
    config = tmp_path / "ssh_config"
    config.write_text(cluster.ssh_config.read_text().replace(str(cluster.user_key), str(wrong)))
    transport = SSHTransport(HostEntry("node0"), ssh_config=config)
    with pytest.raises(AuthFailed) as info:
        transport.run(["true"], timeout=10)
    message = str(info.value)
    assert message.startswith(f"node0 ({cluster.hosts[0].address}:22): authentication failed for user 'root'")
    assert "\n" not in message


@needs_root
def test_user_ssh_config_alias_is_honoured(
    cluster: SSHCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(cluster.ssh_config.read_text())
    monkeypatch.setenv("HOME", str(home))

    settings = resolve_settings(HostEntry("node1"))
    assert (settings.hostname, settings.port, settings.user) == (cluster.hosts[1].address, 22, "root")
    assert settings.known_hosts == cluster.known_hosts
    with SSHTransport(HostEntry("node1")) as transport:
        result = transport.run(["ip", "-o", "-4", "addr", "show"], timeout=10)
    assert cluster.hosts[1].address in result.stdout

    # the hostfile's port wins over the config's, as with ssh
    with pytest.raises(HostUnreachable, match="connection refused"):
        SSHTransport(HostEntry("node1", port=2222)).connect()


@needs_root
def test_reconnects_after_close(node0: SSHTransport) -> None:
    assert node0.run(["true"], timeout=10).ok
    node0.close()
    assert not node0.connected
    assert node0.run(["true"], timeout=10).ok
    assert node0.connected


# -- long-running remote processes -----------------------------------------------------------------


@needs_root
def test_start_reads_output_and_terminate_leaves_nothing(node0: SSHTransport, cluster: SSHCluster) -> None:
    token = f"ffctl-agent-{secrets.token_hex(4)}"
    script = 'echo "ready $FFCTL_TEST_VALUE"; echo warning >&2; sleep 300 & sleep 301; wait'
    proc = node0.start(["sh", "-c", script, token], {"FFCTL_TEST_VALUE": "it's a value"})
    assert proc.remote_pid is not None
    lines = {proc.read_line(10), proc.read_line(10)}
    assert {(line.stream, line.text) for line in lines if line} == {
        (Stream.STDOUT, "ready it's a value"),
        (Stream.STDERR, "warning"),
    }
    assert proc.poll() is None
    assert _eventually(lambda: len(_group_alive(proc.remote_pid)) == 3)  # sh and two sleeps
    assert _pgrep(cluster, token)  # the wrapper, its watcher and the command

    status = proc.terminate(timeout=10)
    assert status == 143  # SIGTERM, reported by the wrapper that outlives the group
    assert _eventually(lambda: not _group_alive(proc.remote_pid))
    # The wrapper's watcher subshell (its command line too) is SIGKILLed as the wrapper exits.
    assert _eventually(lambda: _pgrep(cluster, token) == []), _pgrep(cluster, token)
    list(proc.iter_lines(5))  # whatever the shell said on the way out
    assert proc.output_closed and proc.read_line(0.1) is None


@needs_root
def test_environment_is_not_on_any_command_line(node0: SSHTransport, cluster: SSHCluster) -> None:
    secret = f"s3cret-{secrets.token_hex(6)}"
    proc = node0.start(["sh", "-c", 'echo "$FFCTL_TOKEN"; sleep 300'], {"FFCTL_TOKEN": secret})
    try:
        assert proc.read_line(10).text == secret  # type: ignore[union-attr]
        assert _pgrep(cluster, secret) == []
    finally:
        proc.terminate()


@needs_root
def test_terminate_kills_a_process_that_ignores_sigterm(node0: SSHTransport, cluster: SSHCluster) -> None:
    token = f"ffctl-stubborn-{secrets.token_hex(4)}"
    proc = node0.start(["sh", "-c", "trap '' TERM; echo up; sleep 300 & wait", token], grace_s=0.5)
    assert proc.read_line(10).text == "up"  # type: ignore[union-attr]
    started = time.monotonic()
    status = proc.terminate(timeout=10)
    assert status == 137  # SIGKILL after the grace period
    assert time.monotonic() - started < 5
    assert _eventually(lambda: not _group_alive(proc.remote_pid))
    # The wrapper's watcher subshell (its command line too) is SIGKILLed as the wrapper exits.
    assert _eventually(lambda: _pgrep(cluster, token) == []), _pgrep(cluster, token)


@needs_root
def test_closing_the_transport_kills_remote_processes(cluster: SSHCluster) -> None:
    token = f"ffctl-orphan-{secrets.token_hex(4)}"
    transport = SSHTransport(HostEntry("node0"), ssh_config=cluster.ssh_config)
    proc = transport.start(["sh", "-c", "echo up; sleep 300 & wait", token])
    assert proc.read_line(10).text == "up"  # type: ignore[union-attr]
    transport.close()  # as if the controller died: the connection just goes away
    assert _eventually(lambda: _pgrep(cluster, token) == [])
    assert _eventually(lambda: not _group_alive(proc.remote_pid))


@needs_root
def test_process_exit_status_and_cwd(node0: SSHTransport, cluster: SSHCluster) -> None:
    proc = node0.start(["sh", "-c", "pwd; printf partial; exit 7"], cwd=str(cluster.workdir))
    assert proc.wait(10) == 7
    assert [(line.stream, line.text) for line in proc.iter_lines(5)] == [
        (Stream.STDOUT, str(cluster.workdir)),
        (Stream.STDOUT, "partial"),  # a last line without newline is kept
    ]
    assert proc.output_closed
    proc.close()


@needs_root
def test_start_of_a_missing_command(node0: SSHTransport) -> None:
    with pytest.raises(RemoteCommandMissing) as info:
        node0.start(["ffctl-no-such-agent", "agent"])
    assert str(info.value).startswith("node0: ffctl-no-such-agent is not installed")
    with pytest.raises(SSHError, match=r"^node0: cannot start `true`: .*"):
        node0.start(["true"], cwd="/no/such/dir")
    with pytest.raises(ValueError):
        node0.start(["true"], {"BAD NAME": "x"})


@needs_root
def test_spawn_detached_survives_the_connection(cluster: SSHCluster) -> None:
    token = f"ffctl-switch-{secrets.token_hex(4)}"
    marker = cluster.workdir / token
    transport = SSHTransport(HostEntry("node0"), ssh_config=cluster.ssh_config)
    transport.spawn_detached(["sh", "-c", 'sleep 1.5; touch "$1"', token, str(marker)], timeout=10)
    transport.close()
    assert _pgrep(cluster, token)  # still running with the connection gone
    assert _eventually(marker.exists, timeout=10)
    assert _eventually(lambda: _pgrep(cluster, token) == [])

    with pytest.raises(RemoteCommandMissing, match=r"^node0: ffctl-no-such-command is not installed"):
        SSHTransport(HostEntry("node0"), ssh_config=cluster.ssh_config).spawn_detached(
            ["ffctl-no-such-command"], timeout=10
        )


# -- files -------------------------------------------------------------------------------------------


@needs_root
def test_get_and_put_file(node0: SSHTransport, cluster: SSHCluster, tmp_path: Path) -> None:
    remote = cluster.workdir / "rank0.log"
    node0.run(["sh", "-c", 'printf "line 1\\nline 2\\n" > "$1"', "sh", str(remote)], timeout=10)
    local = tmp_path / "logs" / "rank0.log"
    local.parent.mkdir()
    node0.get_file(str(remote), local)
    assert local.read_bytes() == b"line 1\nline 2\n"

    payload = tmp_path / "payload.bin"
    payload.write_bytes(os.urandom(100_000))
    node0.put_file(payload, str(cluster.workdir / "payload.bin"), timeout=30)
    assert (cluster.workdir / "payload.bin").read_bytes() == payload.read_bytes()

    with pytest.raises(SSHError, match=r"^node0: cannot copy /no/such/file: No such file"):
        node0.get_file("/no/such/file", tmp_path / "x")



# -- settings (no sshd needed) ---------------------------------------------------------------------


def test_settings_follow_ssh_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "config"
    config.write_text(
        "Host gpu*\n"
        "    HostName %h.cluster.example\n"
        "    User trainer\n"
        "    Port 2200\n"
        "    IdentityFile ~/.ssh/cluster_key\n"
        "    IdentitiesOnly yes\n"
        "    UserKnownHostsFile ~/.ssh/cluster_known_hosts ~/.ssh/other_known_hosts\n"
    )
    s = resolve_settings(HostEntry("gpu1"), ssh_config=config)
    assert (s.hostname, s.port, s.user) == ("gpu1.cluster.example", 2200, "trainer")
    assert s.identity_files == (str(tmp_path / ".ssh" / "cluster_key"),)
    assert s.identities_only
    assert s.known_hosts == tmp_path / ".ssh" / "cluster_known_hosts"  # new keys go to the first
    assert s.label == "gpu1 (gpu1.cluster.example:2200)"

    # user@host:port from the hostfile wins over the config, as on ssh's command line
    s = resolve_settings(HostEntry("gpu1", user="alice", port=22), ssh_config=config)
    assert (s.user, s.port) == ("alice", 22)

    # a host the config does not mention: defaults, and known_hosts in ~/.ssh
    s = resolve_settings(HostEntry("plain"), ssh_config=config, known_hosts=tmp_path / "kh")
    assert (s.hostname, s.port, s.identity_files, s.identities_only) == ("plain", 22, (), False)
    assert s.known_hosts == tmp_path / "kh"
    assert s.label == "plain"


def test_bad_port_in_config_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host n\n    Port many\n")
    with pytest.raises(SSHError, match=r"^n: bad Port 'many' in .*config$"):
        resolve_settings(HostEntry("n"), ssh_config=config)
