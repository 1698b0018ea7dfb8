"""`ffctl doctor` checks against real sshd hosts in network namespaces, and the local machine."""
from __future__ import annotations

import platform
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from rich.console import Console

import ffctl
from ffctl.hosts.doctor import HostReport, QdiscSupport, check_host, check_hosts, check_local
from ffctl.hosts.hostfile import HostEntry
from ffctl.render.host_checks import render_doctor
from ffctl.hosts.ssh.remote import SSHTransport
from tests.conftest import ROOT, needs_root
from tests.helpers.sshd import SSHCluster, checked_sshd_cluster, empty_known_hosts
from tests.helpers.sshd import no_ssh_agent  # noqa: F401 - autouse fixture

# sshd hosts in network namespaces built, then checked over SSH.
pytestmark = [pytest.mark.root, pytest.mark.timeout(180)]

# The interpreter running the tests has torch; the checkout on PYTHONPATH makes ffctl
# importable on the namespace hosts as an installed ffctl would be.
PYTHON = sys.executable


@pytest.fixture(scope="module")
def cluster() -> Iterator[SSHCluster]:
    with checked_sshd_cluster(2, setenv={"PYTHONPATH": str(ROOT)}) as c:
        yield c


def _transport(cluster: SSHCluster, name: str) -> SSHTransport:
    return SSHTransport(HostEntry(name), ssh_config=cluster.ssh_config, connect_timeout=5)


@needs_root
def test_namespace_host_is_ready(cluster: SSHCluster) -> None:
    with _transport(cluster, "node0") as transport:
        report = check_host(transport, python=PYTHON)
    assert report.ssh_ok and report.error is None
    assert report.host == "node0"
    assert report.python == platform.python_version()
    assert report.torch == torch.__version__
    assert report.ffctl == ffctl.__version__
    assert report.can_run_job
    assert report.is_root is True
    assert report.iptables and report.tc
    assert report.tbf is QdiscSupport.USABLE
    assert report.netem is QdiscSupport.ABSENT  # this kernel has no sch_netem
    assert report.mem_available_bytes and report.mem_available_bytes > 0
    assert report.shm_free_bytes is not None
    # Same machine, same clock: the estimate is off by at most half the round trip (NTP's bound).
    assert report.clock_offset_s is not None and report.clock_rtt_s is not None
    assert 0 < report.clock_rtt_s < 2
    assert abs(report.clock_offset_s) <= report.clock_rtt_s / 2 + 0.001
    assert any("netem" in p for p in report.problems())


@needs_root
def test_clock_offset_follows_the_controller_clock(cluster: SSHCluster) -> None:
    # A controller clock 100 s behind means the host is 100 s ahead: offset is host - controller.
    with _transport(cluster, "node1") as transport:
        report = check_host(transport, python=PYTHON, controller_time_fn=lambda: time.time() - 100.0)
    assert report.clock_offset_s is not None
    assert report.clock_rtt_s is not None
    assert abs(report.clock_offset_s - 100.0) <= report.clock_rtt_s / 2 + 0.001
    assert any("clock is +100" in p for p in report.problems())


@needs_root
def test_python_without_ffctl_is_reported_missing(cluster: SSHCluster, tmp_path: Path) -> None:
    # The same interpreter (torch and all), but an `ffctl` package that fails to import comes
    # first on its path: the host looks exactly like one where ffctl was never installed.
    shadow = tmp_path / "shadow" / "ffctl"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named ffctl')\n")
    bare = tmp_path / "python-without-ffctl"
    bare.write_text(f"#!/bin/sh\nexec env PYTHONPATH={shadow.parent} {PYTHON} \"$@\"\n")
    bare.chmod(0o755)
    with _transport(cluster, "node0") as transport:
        report = check_host(transport, python=str(bare))
    assert report.ssh_ok
    assert report.python == platform.python_version()
    assert report.torch == torch.__version__
    assert report.ffctl is None
    assert not report.can_run_job
    assert f"ffctl is not installed for {bare}" in report.problems()


@needs_root
def test_missing_python_is_reported(cluster: SSHCluster) -> None:
    with _transport(cluster, "node0") as transport:
        report = check_host(transport, python="python-ffctl-missing")
    assert report.ssh_ok
    assert (report.python, report.torch, report.ffctl) == (None, None, None)
    assert not report.can_run_job
    assert report.problems()[0] == "python-ffctl-missing not found: ffctl cannot run here"
    assert report.tbf is QdiscSupport.USABLE  # the other checks do not need python


@needs_root
def test_unreachable_host(cluster: SSHCluster) -> None:
    address = cluster.unused_address
    transport = SSHTransport(
        HostEntry(address, user="root"), ssh_config=cluster.ssh_config, connect_timeout=1.5
    )
    started = time.monotonic()
    report = check_host(transport, python=PYTHON)
    assert time.monotonic() - started < 5
    assert not report.ssh_ok and not report.can_run_job
    assert report.error is not None and report.error.startswith(f"{address}: ")
    assert "\n" not in report.error
    assert report.problems() == (report.error,)
    assert report.python is None


@needs_root
def test_refused_port_and_unknown_key_are_errors_not_exceptions(cluster: SSHCluster, tmp_path: Path) -> None:
    refused = SSHTransport(HostEntry("node0", port=2222), ssh_config=cluster.ssh_config)
    empty = empty_known_hosts(tmp_path)
    unknown = SSHTransport(HostEntry("node1"), ssh_config=cluster.ssh_config, known_hosts=empty)
    reports = check_hosts([refused, unknown], python=PYTHON)
    assert [r.host for r in reports] == ["node0", "node1"]
    assert "connection refused" in (reports[0].error or "")
    assert "--accept-new-host-keys" in (reports[1].error or "")
    assert not any(r.can_run_job for r in reports)


def test_local_machine() -> None:
    # A generous limit: the probe imports torch in a fresh interpreter, which took over the
    # default 15 s on a host loaded by a full suite beside other work (torch then read as absent).
    report = check_local(timeout=120)
    assert report.ssh_ok and report.host == "localhost"
    assert report.python_cmd == sys.executable
    assert report.python == platform.python_version()
    assert report.torch == torch.__version__
    assert report.ffctl == ffctl.__version__
    assert report.can_run_job
    assert report.clock_offset_s is not None and report.clock_rtt_s is not None
    assert abs(report.clock_offset_s) <= report.clock_rtt_s / 2 + 0.001


def test_reports_are_frozen_and_python_age_is_checked() -> None:
    old = HostReport("h", True, python="3.8.10", torch="2.0", ffctl="0.1.0")
    assert old.python_too_old and not old.can_run_job
    assert any("needs 3.10 or newer" in p for p in old.problems())
    with pytest.raises(AttributeError):
        old.host = "other"  # type: ignore[misc]


def test_render_doctor() -> None:
    ok = HostReport(
        "node0", True, python="3.11.7", torch="2.13.0", ffctl="0.1.0", is_root=True,
        mem_available_bytes=8 * 1024**3, shm_free_bytes=4 * 1024**3, iptables=True, tc=True,
        tbf=QdiscSupport.USABLE, netem=QdiscSupport.ABSENT, clock_offset_s=0.0012,
        clock_rtt_s=0.002,
    )
    down = HostReport("node1", False, error="node1 (10.9.9.9:22): connection refused on 10.9.9.9:22")
    console = Console(record=True, width=250, color_system=None)
    render_doctor([ok, down], console)
    text = console.export_text()
    assert "node0" in text and "node1" in text
    assert "3.11.7" in text and "2.13.0" in text and "8.0 GiB" in text
    assert "+1.2 ms" in text
    assert "✓" in text and "✗" in text
    assert "node1 (10.9.9.9:22): connection refused on 10.9.9.9:22" in text
    assert "node0: kernel has no netem qdisc" in text
