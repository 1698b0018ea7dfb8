"""`ffctl launch --hosts` with bad input or broken hosts: one line naming the host, the right exit
code (2: hostfile, host key, login key; 3: unreachable, no python or ffctl) and nothing started or
left anywhere. Every host is checked before any agent starts, so a bad host among good ones
leaves no agent on the good ones either.
"""
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
    ffctl_in_namespaces,
    make_home,
    make_site,
    one_line,
    processes_under,
    ssh_config_text,
)
from tests.helpers.sshd import checked_sshd_cluster, generate_ed25519

# sshd hosts in network namespaces built; each case checks every host before it fails.
pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

# The hosts' python: FFCTL_TEST_PYTHON, set per host by its sshd, makes it a python that cannot
# import ffctl (isolated, no site-packages) or one that is not installed at all.
HOST_PYTHON = f"""#!/bin/sh
case "${{FFCTL_TEST_PYTHON:-}}" in
  missing) echo "python3: command not found" >&2; exit 127 ;;
  bare) exec {sys.executable} -I -S "$@" ;;
esac
exec {sys.executable} "$@"
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    with checked_sshd_cluster(3, setenv=SETENV, host_setenv={1: {"FFCTL_TEST_PYTHON": "bare"},
                                                             2: {"FFCTL_TEST_PYTHON": "missing"}}) as cluster:
        made = make_site(cluster, tmp_path_factory.mktemp("multihost-errors"))
        python = made.cwd / "hostpython"
        python.write_text(HOST_PYTHON)
        python.chmod(0o755)
        yield made


def launch(site: Site, run_id: str, hosts: Path, *args: str, home: Path | None = None) -> str:
    """Launch, expect failure before anything starts; the one stderr line, for the caller."""
    out = site.launch(run_id, hosts, "--steps", "5", "--remote-python", str(site.cwd / "hostpython"), *args,
                      home=home, timeout=180)
    line = one_line(out.stderr)
    assert line.startswith("ffctl: error: ")
    assert not site.record(run_id).exists(), "a run record was created"
    assert not (site.remote / run_id).exists(), "a host's run directory was created"
    assert ffctl_in_namespaces(site.cluster) == [], "something ffctl runs on a host"
    assert processes_under(site.remote) == []
    return f"{out.returncode} {line[len('ffctl: error: '):]}"


@needs_root
def test_malformed_hostfile_line(site: Site) -> None:
    hosts = site.hostfile("node0 slots=2", "node1 slots=two", name="bad-slots")
    got = launch(site, "malformed", hosts)
    assert got.startswith("2 ") and f"{hosts}:2" in got and "'two'" in got


@needs_root
def test_bad_host_name_in_hostfile(site: Site) -> None:
    hosts = site.hostfile("node0", "node1;reboot", name="bad-name")
    got = launch(site, "badname", hosts)
    assert got.startswith("2 ") and f"{hosts}:2" in got and "'node1;reboot'" in got


@needs_root
def test_unequal_slots_are_refused(site: Site) -> None:
    hosts = site.hostfile("node0 slots=1", "node1 slots=2", name="unequal")
    got = launch(site, "unequal", hosts)
    assert got.startswith("2 ") and "node0 1" in got and "node1 2" in got and "unequal slots" in got


@needs_root
def test_unreachable_host(site: Site) -> None:
    unreachable = site.cluster.unused_address
    hosts = site.hostfile("node0", unreachable, name="unreachable")
    got = launch(site, "unreachable", hosts)
    assert got.startswith(f"3 {unreachable}: ")


@needs_root
def test_unknown_host_key(site: Site, tmp_path: Path) -> None:
    known = copy_known_hosts(site.cluster, tmp_path / "known_hosts", keep=["node0"])
    home = make_home(site.cluster, tmp_path / "home", ssh_config_text(site.cluster, known_hosts=known))
    hosts = site.hostfile("node0", "node1", name="unknown-key")
    got = launch(site, "unknownkey", hosts, home=home)
    assert got.startswith("2 node1 ") and "unknown host key" in got and "--accept-new-host-keys" in got
    assert site.cluster.hosts[1].address not in known.read_text()  # nothing was saved


@needs_root
def test_changed_host_key(site: Site, tmp_path: Path) -> None:
    node0, node1 = site.cluster.hosts[:2]
    known = tmp_path / "known_hosts"
    known.write_text(f"{node0.address} {node0.host_public_key}\n{node1.address} {node0.host_public_key}\n")
    home = make_home(site.cluster, tmp_path / "home", ssh_config_text(site.cluster, known_hosts=known))
    hosts = site.hostfile("node0", "node1", name="changed-key")
    got = launch(site, "changedkey", hosts, "--accept-new-host-keys", home=home)
    assert got.startswith("2 node1 ") and "HOST KEY CHANGED" in got


@needs_root
def test_refused_login_key(site: Site, tmp_path: Path) -> None:
    stranger = tmp_path / "id_stranger"
    generate_ed25519(stranger, "not-authorized")
    home = make_home(site.cluster, tmp_path / "home",
                     ssh_config_text(site.cluster, identity={"node1": stranger}))
    hosts = site.hostfile("node0", "node1", name="refused")
    got = launch(site, "refused", hosts, home=home)
    assert got.startswith("2 node1 ") and "authentication failed" in got


@needs_root
def test_host_without_ffctl(site: Site) -> None:
    hosts = site.hostfile("node0", "node1", name="no-ffctl")
    got = launch(site, "noffctl", hosts)
    assert got.startswith("3 node1: ") and "ffctl cannot run there" in got and "No module named 'ffctl'" in got


@needs_root
def test_host_without_python(site: Site) -> None:
    hosts = site.hostfile("node0", "node2", name="no-python")
    got = launch(site, "nopython", hosts)
    assert got.startswith("3 node2: ") and "is not installed there" in got


@needs_root
def test_every_failing_host_is_counted_and_the_first_named(site: Site) -> None:
    hosts = site.hostfile("node0", "node1", "node2", name="two-bad")
    got = launch(site, "twobad", hosts)
    assert got.startswith("3 node1: ") and "and 1 more host(s)" in got


@needs_root
@pytest.mark.parametrize("addr", ["0.0.0.0", "192.0.2.7", "not-an-address"])
def test_master_addr_must_be_an_address_of_this_machine(site: Site, addr: str) -> None:
    hosts = site.hostfile("node0", name="one-host")
    got = launch(site, f"master-{addr.replace('.', '-')}", hosts, "--master-addr", addr)
    assert got.startswith(f"2 --master-addr {addr}")
