"""`ffctl doctor` as a user runs it: this machine, the namespace hosts of a hostfile, an
unreachable host (exit 3), an unknown host key with and without --accept-new-host-keys, and a
bad hostfile (exit 2)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import needs_root
from tests.helpers.multihost import (
    SETENV,
    Site,
    copy_known_hosts,
    make_home,
    make_site,
    one_line,
    ssh_config_text,
)
from tests.helpers.sshd import checked_sshd_cluster

# sshd hosts in network namespaces built, then doctor's checks over SSH against each.
pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with checked_sshd_cluster(2, setenv=SETENV) as cluster:
        yield make_site(cluster, tmp_path_factory.mktemp("doctor-cli"))


def doctor(site: Site, *args: str, home: Path | None = None) -> tuple[int, str, str]:
    out = site.ffctl("doctor", "--remote-python", sys.executable, *args, home=home, timeout=240)
    return out.returncode, out.stdout, out.stderr


def row(stdout: str, host: str) -> str:
    """The table row of `host` (the table is drawn wide enough for one line per host)."""
    rows = [line for line in stdout.splitlines() if line.startswith("│") and f" {host} " in line]
    assert len(rows) == 1, stdout
    return rows[0]


@needs_root
def test_this_machine(site: Site) -> None:
    out = site.ffctl("doctor", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr  # it runs these tests: torch and ffctl are here
    assert "ffctl doctor" in out.stdout
    assert "✓" in row(out.stdout, "localhost")


@needs_root
def test_namespace_hosts_can_run_jobs(site: Site) -> None:
    hosts = site.hostfile("node0", "node1")
    code, stdout, stderr = doctor(site, "--hosts", str(hosts))
    assert code == 0, stdout + stderr
    for name in ("node0", "node1"):
        line = row(stdout, name)
        assert "✗" not in line.split("│")[2]  # ssh
        assert line.rstrip("│ ").endswith("✓")  # can run a job
        assert " ms" in line  # clock offset measured


@needs_root
def test_unreachable_host_fails_with_exit_3(site: Site) -> None:
    unreachable = site.cluster.unused_address
    hosts = site.hostfile("node0", unreachable, name="with-unreachable")
    code, stdout, stderr = doctor(site, "--hosts", str(hosts), "--timeout", "10")
    assert code == 3, stdout + stderr
    assert "✓" in row(stdout, "node0").split("│")[2]
    problems = [line for line in stdout.splitlines() if line.startswith(f"{unreachable}: ")]
    assert len(problems) == 1 and ("cannot connect" in problems[0] or "no answer" in problems[0])


@needs_root
def test_unknown_host_key_until_accepted(site: Site, tmp_path: Path) -> None:
    known = copy_known_hosts(site.cluster, tmp_path / "known_hosts", keep=["node0"])
    home = make_home(site.cluster, tmp_path / "home", ssh_config_text(site.cluster, known_hosts=known))
    hosts = site.hostfile("node0", "node1", name="unknown-key")
    code, stdout, _ = doctor(site, "--hosts", str(hosts), home=home)
    assert code == 3
    assert any(line.startswith("node1 ") and "unknown host key" in line for line in stdout.splitlines())
    assert site.cluster.hosts[1].address not in known.read_text()

    code, stdout, stderr = doctor(site, "--hosts", str(hosts), "--accept-new-host-keys", home=home)
    assert code == 0, stdout + stderr
    assert f"{site.cluster.hosts[1].address} {site.cluster.hosts[1].host_public_key}" in known.read_text()


@needs_root
def test_bad_hostfile_exits_2(site: Site) -> None:
    hosts = site.hostfile("node0 slots=0", name="bad")
    code, stdout, stderr = doctor(site, "--hosts", str(hosts))
    assert code == 2
    assert f"{hosts}:1" in one_line(stderr) and "'0'" in stderr
    assert stdout == ""
