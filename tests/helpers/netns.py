"""Helpers for tests on real network namespaces: a sandbox that checks it left nothing, TCP
servers and probes inside namespaces, and readers for iptables, tc, links and processes."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from fault_injectors import deadman
from fault_injectors.plan import HostCommand, NodePlace, Topology
from fault_injectors.transport import LocalTransport, Transport
from ffctl.backends.netns import NetnsSandbox, cleanup_stale, list_namespaces

SSH_PORT = 22


def transport_for(cmd: HostCommand) -> Transport:
    return LocalTransport(cmd.host, cmd.netns)


def in_ns(netns: str | None, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv] if netns else list(argv)


def sh(netns: str | None, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(in_ns(netns, argv), capture_output=True, text=True, timeout=timeout, check=False)


def topology(sb: NetnsSandbox, run_id: str, store_port: int = 0) -> Topology:
    nodes = tuple(sb.node_place(n.index, agent_pid=0) for n in sb.nodes)
    return Topology(run_id, nodes, (), controller_address=sb.controller_address, store_port=store_port,
                    ssh_port=SSH_PORT)


def leftovers(sb: NetnsSandbox, run_id: str) -> list[str]:
    """Everything of this sandbox and run still on the machine (empty when clean)."""
    left = list_namespaces(sb.prefix)
    left += [p.name for p in Path("/sys/class/net").iterdir() if sb.short in p.name]
    left += [f"deadman pid {pid}" for pid in deadman_pids(run_id)]
    return left


def deadman_pids(run_id: str) -> list[int]:
    out = sh(None, "pgrep", "-f", "--", deadman.pattern(run_id)).stdout
    return [int(p) for p in out.split()]


@contextmanager
def clean_sandbox(run_id: str, nnodes: int) -> Iterator[NetnsSandbox]:
    """A created sandbox; afterwards its switches are stopped, it is destroyed and checked gone."""
    sb = NetnsSandbox(run_id, nnodes)
    try:
        sb.create()
        yield sb
    finally:
        for pid in deadman_pids(run_id):
            subprocess.run(["kill", "-TERM", str(pid)], check=False)
        try:
            sb.destroy()
        finally:
            cleanup_stale(sb.prefix)
    assert not leftovers(sb, run_id), leftovers(sb, run_id)


_SERVER = """
import selectors, socket, sys
sel = selectors.DefaultSelector()
for port in sys.argv[2:]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(port)))
    s.listen(64)
    sel.register(s, selectors.EVENT_READ)
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept()
        conn.sendall(b"hi")
        conn.close()
"""

_CLIENT = """
import json, socket, sys, time
out = []
for addr, port in json.loads(sys.argv[2]):
    t0 = time.monotonic()
    try:
        with socket.create_connection((addr, port), timeout=float(sys.argv[1])) as c:
            c.settimeout(float(sys.argv[1]))
            out.append("ok" if c.recv(2) == b"hi" else "bad")
    except socket.timeout:
        out.append("timeout")
    except ConnectionRefusedError:
        out.append("refused")
    except OSError as exc:
        out.append(type(exc).__name__ + ":" + str(exc.errno))
print(json.dumps(out))
"""


@contextmanager
def tcp_server(netns: str | None, address: str, ports: Sequence[int]) -> Iterator[None]:
    """A TCP server inside `netns` answering "hi" on each port, killed afterwards."""
    proc = subprocess.Popen(in_ns(netns, [sys.executable, "-c", _SERVER, address, *map(str, ports)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else line
        yield
    finally:
        proc.kill()
        proc.wait(timeout=30)


def connect(netns: str | None, targets: Sequence[tuple[str, int]], timeout: float = 2.5) -> list[str]:
    """Connect from `netns` (None: the root namespace, the controller's) to each (address, port):
    "ok", "timeout", "refused" or the error."""
    proc = sh(netns, sys.executable, "-c", _CLIENT, str(timeout), json.dumps([list(t) for t in targets]),
              timeout=30 + timeout * len(targets))
    assert proc.returncode == 0, proc.stderr
    answers: list[str] = json.loads(proc.stdout)
    return answers


def ffctl_chains(netns: str | None) -> list[str]:
    out = sh(netns, "iptables", "-w", "-S").stdout
    return [line for line in out.splitlines() if "FFCTL-" in line or "ffctl:" in line]


def qdiscs(netns: str | None, dev: str) -> str:
    return sh(netns, "tc", "qdisc", "show", "dev", dev).stdout


def link(netns: str | None, dev: str) -> tuple[bool, str]:
    """(administratively up, alias) of a link."""
    out = sh(netns, "ip", "-d", "-j", "link", "show", "dev", dev)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)[0]
    return "UP" in info.get("flags", []), info.get("ifalias", "")


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def place(sb: NetnsSandbox, index: int) -> NodePlace:
    return sb.node_place(index, agent_pid=0)
