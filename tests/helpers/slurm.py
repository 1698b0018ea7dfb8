"""A private Slurm cluster on this machine for the tests marked `slurm`: munged, slurmctld and a
few slurmd, each node with its own name (`slurmd -N nX`), port, spool directory and hostname (a
UTS namespace of its own, so a job step sees its node's name), and either its own network
namespace on a private bridge (entered with `nsenter --net`: slurmd's cgroup plugin dies under
`ip netns exec`) or, without `netns`, every daemon on loopback.

`slurm_cluster()` writes slurm.conf and a munge key in a temporary directory, starts the
daemons in the foreground as children of the test, waits for every node to be idle, and on the
way out (failures included) cancels every job, stops the daemons and checks that no job, step or
daemon is left. `skip_reason()` says why a machine cannot run one (not root, packages missing).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from ffctl.backends.netns import NetnsSandbox

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scancel", "scontrol", "squeue", "sinfo")
PACKAGES = "slurmctld slurmd slurm-client munge"
UP_TIMEOUT_S = 30.0


def _which(tool: str) -> str | None:
    return shutil.which(tool) or next((p for p in (f"/usr/sbin/{tool}", f"/sbin/{tool}") if os.access(p, os.X_OK)), None)


def skip_reason() -> str | None:
    """Why this machine cannot run a private Slurm cluster, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs job steps as their user; munged and the hostnames need root)"
    missing = [t for t in (*DAEMONS, *CLIENTS, "unshare", "nsenter") if _which(t) is None]
    if missing:
        return f"Slurm not installed (missing {', '.join(missing)}): apt-get install {PACKAGES} (scripts/setup does as root)"
    return None


def _free_ports(n: int) -> list[int]:
    """`n` consecutive free TCP ports on loopback (Slurm's `Port=[a-b]` takes a range)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return list(range(base, base + n))
    raise RuntimeError("no free port range on loopback")


@dataclass
class SlurmCluster:
    """A running private cluster: its directory, its nodes, and the environment its clients
    (`sbatch`, `srun`, ...) need (`SLURM_CONF`)."""

    root: Path
    nodes: list[str]
    env: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def run(self, argv: Sequence[str], timeout: float = 30.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=self.env, check=check)

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it (``idle``, ``alloc``, ``down*``, ``drain``...)."""
        out = self.run(["sinfo", "--Node", "--noheader", "--format=%N %T"]).stdout
        states: dict[str, str] = {}
        for line in out.splitlines():
            words = line.split()
            if len(words) == 2:
                states[words[0]] = words[1]
        return states

    def jobs(self) -> list[str]:
        """Every job the controller still has (any state but gone)."""
        return self.run(["squeue", "--noheader", "--format=%i %T %j"]).stdout.splitlines()

    def steps(self) -> list[str]:
        return self.run(["squeue", "--steps", "--noheader", "--format=%i %j"]).stdout.splitlines()

    def wait_idle(self, timeout: float = UP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values()):
                return
            self._check_alive()
            time.sleep(0.1)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:g}s: {states}; logs:\n{self.logs()}")

    def _check_alive(self) -> None:
        dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise RuntimeError(f"Slurm daemon(s) exited: {dead}; logs:\n{self.logs()}")

    def logs(self, lines: int = 15) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"== {log.name}\n" + "\n".join(tail))
        return "\n".join(out)

    def wait_empty(self, timeout: float = 20.0) -> list[str]:
        """Wait for no job and no step to be left; what is left after `timeout`."""
        deadline = time.monotonic() + timeout
        left = self.jobs() + self.steps()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.jobs() + self.steps()
        return left


def _conf(root: Path, nodes: Sequence[str], ctld_port: int, node_ports: Sequence[int], cpus: int,
          addresses: Sequence[str] | None = None, ctld_address: str = "127.0.0.1") -> str:
    host = socket.gethostname()
    names = f"{nodes[0].rstrip('0123456789')}[1-{len(nodes)}]"
    if addresses is None:
        # Every slurmd on loopback: one line, a port each.
        node_lines = [f"NodeName={names} NodeHostname={host} NodeAddr=127.0.0.1 "
                      f"Port=[{node_ports[0]}-{node_ports[-1]}] CPUs={cpus} State=UNKNOWN"]
    else:
        # Each slurmd in its own network namespace, at its own address.
        node_lines = [f"NodeName={n} NodeHostname={n} NodeAddr={a} Port={p} CPUs={cpus} State=UNKNOWN"
                      for n, a, p in zip(nodes, addresses, node_ports)]
    return "\n".join([
        "ClusterName=ffctltest",
        f"SlurmctldHost={host}({ctld_address})",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.sock",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # No cgroup and no accounting: steps are tracked by their process tree.
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # More CPUs than this machine has: the nodes share it, and their steps overlap.
        "SlurmdParameters=config_overrides",
        "ReturnToService=1",  # a node set down stays down until resumed
        "SlurmdTimeout=5",
        "InactiveLimit=0",
        "KillWait=2",
        "MinJobAge=2",
        "MessageTimeout=5",
        "MailProg=/bin/true",
        *node_lines,
        f"PartitionName=test Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])


def _stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


@contextmanager
def slurm_cluster(tmp: Path, nnodes: int = 3, cpus: int = 4, netns: bool = False) -> Iterator[SlurmCluster]:
    """A private Slurm cluster of `nnodes` idle nodes ``n1``.. (see the module docstring); torn
    down afterwards, asserting that no job, step or daemon is left. With `netns`, each slurmd
    (and so each node's steps) runs in a network namespace of its own on a private bridge
    (`NetnsSandbox`'s), slurmctld on the bridge's address; else all on loopback."""
    if netns:
        from ffctl.backends.netns import NetnsSandbox, cleanup_stale

        sandbox = NetnsSandbox(f"slurm-{os.urandom(3).hex()}", nnodes).create()
        try:
            with _cluster(tmp, nnodes, cpus, sandbox) as cluster:
                yield cluster
        finally:
            try:
                sandbox.destroy()
            finally:
                cleanup_stale(sandbox.prefix)
    else:
        with _cluster(tmp, nnodes, cpus, None) as cluster:
            yield cluster


@contextmanager
def _cluster(tmp: Path, nnodes: int, cpus: int, sandbox: NetnsSandbox | None) -> Iterator[SlurmCluster]:
    root = tmp / "slurm"
    (root / "state").mkdir(parents=True)
    nodes = [f"n{i}" for i in range(1, nnodes + 1)]
    for n in nodes:
        (root / "spool" / n).mkdir(parents=True)
    os.chmod(root, 0o755)
    ports = _free_ports(nnodes + 1)
    conf = root / "slurm.conf"
    if sandbox is None:
        conf.write_text(_conf(root, nodes, ports[0], ports[1:], cpus))
    else:
        conf.write_text(_conf(root, nodes, ports[0], ports[1:], cpus, [n.address for n in sandbox.nodes],
                              sandbox.controller_address))
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for var in [v for v in env if v.startswith("SLURM_") and v != "SLURM_CONF"]:
        env.pop(var)  # a test run inside a real allocation must not talk to it
    cluster = SlurmCluster(root, nodes, env)

    def start(name: str, argv: list[str]) -> None:
        log = open(root / f"{name}.out.log", "ab")
        cluster.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                               start_new_session=True)
        log.close()

    try:
        start("munged", [_which("munged") or "munged", "--foreground", "--force", f"--socket={root}/munge.sock",
                         f"--key-file={key}", f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
                         f"--seed-file={root}/munge.seed", "--num-threads=2"])
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not (root / "munge.sock").exists():
            cluster._check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start:\n{cluster.logs()}")
            time.sleep(0.05)
        start("slurmctld", [_which("slurmctld") or "slurmctld", "-D", "-c", "-i", "-f", str(conf)])
        for i, n in enumerate(nodes):
            # Its own hostname (UTS namespace), so the node's steps see the node's name.
            argv = ["unshare", "--uts", "sh", "-c", 'hostname "$1" && exec "$2" -D -N "$1" -f "$3"',
                    "sh", n, _which("slurmd") or "slurmd", str(conf)]
            if sandbox is not None:
                # Only the network namespace: slurmd needs this machine's /sys (its cgroup
                # plugin dies under `ip netns exec`, which mounts a /sys of the namespace's).
                argv = ["nsenter", f"--net=/run/netns/{sandbox.nodes[i].netns}", *argv]
            start(f"slurmd-{n}", argv)
        cluster.wait_idle()
        yield cluster
    finally:
        left = _teardown(cluster)
    assert not left, left


def _teardown(cluster: SlurmCluster) -> list[str]:
    """Cancel every job, check none is left and every node is idle, stop the daemons; what was
    left behind (empty when clean)."""
    left: list[str] = []
    ctld = cluster.procs.get("slurmctld")
    if ctld is not None and ctld.poll() is None:
        cluster.run(["scancel", "--full", "--user=root"])
        left += [f"job/step left: {line}" for line in cluster.wait_empty()]
        states = cluster.node_states()
        left += [f"node {n} {s}" for n, s in states.items() if s != "idle"]
    for name in [n for n in cluster.procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]:
        proc = cluster.procs.get(name)
        if proc is not None:
            _stop(proc)
    # Any process still started with this cluster's config (a step daemon of a step that did not
    # end, a task it lost) is a leak: reported, then killed so that the next test starts clean.
    for pid in _processes_of(cluster.env["SLURM_CONF"]):
        left.append(f"process {pid} left: {_cmdline(pid)}")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return left


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _processes_of(conf: str) -> list[int]:
    """Every process whose environment names `conf` as its SLURM_CONF (the daemons pass theirs
    on to step daemons and tasks)."""
    needle = f"SLURM_CONF={conf}".encode()
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry.name))
    return found
