"""Multi-host launches against sshd hosts in network namespaces (see tests/helpers/sshd.py).

The namespace hosts share this machine's filesystem and process table, so `python3` on their
PATH can be the interpreter running the tests (torch and ffctl importable) and a host's
processes are found with `ip netns pids`. `ffctl` runs as a user would run it, as a subprocess,
with a HOME whose ~/.ssh/config is the cluster's (aliases, keys, known_hosts) and no SSH agent.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

from runs.events import Event
from runs.store import iter_events
from tests.helpers.sshd import SSHCluster

PYTHON_DIR = os.path.dirname(sys.executable)
# What the hosts' sessions get: `python3` is the test interpreter; sbin for ip and iptables.
HOST_PATH = f"{PYTHON_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SETENV = {"PATH": HOST_PATH}
TIMEOUT = 420.0


@dataclass(frozen=True)
class Site:
    """A cluster plus the launch host's side: HOME, working dir, runs dir, hosts' runs dir."""

    cluster: SSHCluster
    home: Path
    cwd: Path
    runs: Path
    remote: Path

    def hostfile(self, *lines: str, name: str = "hosts") -> Path:
        path = self.cwd / name
        path.write_text("".join(f"{line}\n" for line in lines))
        return path

    def env(self, home: Path | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "SSH_AUTH_SOCK"}
        # Wide enough for doctor's and report's tables to print whole words.
        env.update(HOME=str(home or self.home), COLUMNS="250", FFCTL_RUNS_DIR=str(self.runs))
        return env

    def ffctl(self, *args: str, home: Path | None = None, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ffctl", *args], cwd=self.cwd, env=self.env(home),
                              capture_output=True, text=True, timeout=timeout, check=False)

    def launch_argv(self, run_id: str, hosts: Path, *args: str) -> list[str]:
        return ["launch", "--hosts", str(hosts), "--run-id", run_id, "--runs-dir", str(self.runs),
                "--remote-runs-dir", str(self.remote), *args]

    def launch(self, run_id: str, hosts: Path, *args: str, home: Path | None = None,
               timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
        return self.ffctl(*self.launch_argv(run_id, hosts, *args), home=home, timeout=timeout)

    def start_launch(self, run_id: str, hosts: Path, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "ffctl", *self.launch_argv(run_id, hosts, *args)],
                                cwd=self.cwd, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)

    def record(self, run_id: str) -> Path:
        return self.runs / run_id

    def events(self, run_id: str) -> list[Event]:
        path = self.record(run_id) / "events.jsonl"
        return list(iter_events(path)) if path.exists() else []

    def report(self, run_id: str) -> dict[str, Any]:
        out = self.ffctl("report", run_id, "--runs-dir", str(self.runs), "--json")
        assert out.returncode == 0, out.stderr
        report: dict[str, Any] = json.loads(out.stdout)
        return report

    def run_info(self, run_id: str) -> dict[str, Any]:
        info: dict[str, Any] = json.loads((self.record(run_id) / "run.json").read_text())
        return info


def make_site(cluster: SSHCluster, base: Path) -> Site:
    home = make_home(cluster, base / "home")
    cwd = base / "work"
    cwd.mkdir(parents=True, exist_ok=True)
    return Site(cluster, home, cwd, cwd / "runs", base / "remote")


def make_home(cluster: SSHCluster, home: Path, ssh_config: str | None = None) -> Path:
    """A HOME whose ~/.ssh/config is the cluster's (or the given text)."""
    ssh = home / ".ssh"
    ssh.mkdir(parents=True, exist_ok=True, mode=0o700)
    (ssh / "config").write_text(ssh_config if ssh_config is not None else cluster.ssh_config.read_text())
    return home


def ssh_config_text(cluster: SSHCluster, *, known_hosts: Path | None = None,
                    identity: dict[str, Path] | None = None) -> str:
    """The cluster's ssh config, with another known_hosts for every host and another key for some."""
    text = ""
    for h in cluster.hosts:
        key = (identity or {}).get(h.alias, cluster.user_key)
        text += (f"Host {h.alias}\n    HostName {h.address}\n    Port {h.port}\n    User root\n"
                 f"    IdentityFile {key}\n    IdentitiesOnly yes\n"
                 f"    UserKnownHostsFile {known_hosts or cluster.known_hosts}\n")
    return text


def ffctl_in_namespaces(cluster: SSHCluster) -> list[str]:
    """Processes living in the hosts' namespaces whose command line mentions ffctl (agents,
    spares, ranks, the SSH wrapper, dead man's switches); sshd itself does not."""
    found = []
    for host in cluster.hosts:
        for pid in cluster.netns_pids(host):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "ffctl" in cmdline and Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
                found.append(f"{host.alias} pid {pid}: {cmdline.strip()[:200]}")
    return found


def processes_under(path: Path) -> list[str]:
    """Live processes whose working directory is inside `path` (agents run in the hosts' run dir)."""
    found = []
    for proc in psutil.process_iter(["pid", "cwd", "cmdline", "status"]):
        cwd = proc.info.get("cwd") or ""
        if proc.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        if cwd == str(path) or cwd.startswith(str(path) + os.sep):
            found.append(f"pid {proc.info['pid']}: {' '.join(proc.info.get('cmdline') or [])[:200]}")
    return found


def iptables_rules(cluster: SSHCluster) -> list[str]:
    """ffctl's iptables rules and chains left in any host's namespace."""
    left = []
    for host in cluster.hosts:
        out = cluster.netns_run(host, ["iptables", "-w", "-S"]).stdout
        left += [f"{host.alias}: {line}" for line in out.splitlines() if "FFCTL-" in line or "ffctl:" in line]
    return left


def eventually(check: Callable[[], Sequence[object]], timeout: float) -> Sequence[object]:
    """Poll `check` until it returns an empty sequence or `timeout` passes; its last answer."""
    deadline = time.monotonic() + timeout
    while True:
        left = check()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    return lines[0]


def copy_known_hosts(cluster: SSHCluster, dest: Path, keep: Sequence[str]) -> Path:
    """A known_hosts holding only the keys of the hosts named in `keep`."""
    dest.write_text("".join(f"{h.address} {h.host_public_key}\n" for h in cluster.hosts if h.alias in keep))
    return dest


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
