"""An unauthenticated client of a real job's control store plays the attacker.

torch's TCPStore has no authentication: anyone who reaches the controller's port can read and
write every key. The job must not care. The attacker watches the agents' queues and the rank
queue from the start, reads the generation plans, and finds the job token nowhere; then it sends
unsealed `stop`, `kill` and a replayed genuine `spawn` to the agents, unsealed `done`, `step`,
`inject_request` and a non-JSON blob to the controller, forges an abort flag of the running
generation and a plan for the next one, and knocks on each agent's snapshot channel without the
token, on its port and on its Unix socket. The job trains on until the test stops it, no rank is
killed or started twice, and the record holds a `message_rejected` event for what was refused.
A sealed `ffctl inject --dry-run` from the run's owner still gets its answer meanwhile.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from wire import control
from runs.events import EventKind
from tests.helpers.launch import (
    assert_nothing_left, crashes, rid, run_ffctl, shm_left, start_launch, stop_at_end, wait_step,
)
from runs.store import iter_events

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# More than the test ever waits for: the test stops the job (Ctrl-C) once the attack is over and
# training has gone on past it, so a slow host cannot end the job under the attacker's feet.
STEPS = 100_000
NNODES = 2


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def _controller_port(run_dir: Path, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ctl = json.loads((run_dir / "run.json").read_text()).get("controller")
        except (OSError, ValueError):
            ctl = None
        if ctl:
            return int(ctl["port"])
        time.sleep(0.02)
    raise AssertionError("the controller never published its endpoint")


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process `pid` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """The IPv4 (address, port) pairs process `pid` listens on, as /proc tells anyone local."""
    inodes = _socket_inodes(pid)
    found = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            addr_hex, port_hex = fields[1].split(":")
            found.append((socket.inet_ntoa(bytes.fromhex(addr_hex)[::-1]), int(port_hex, 16)))
    return found


def _unix_streams(pid: int) -> list[tuple[str, bool]]:
    """The abstract Unix stream sockets process `pid` holds, as (name, listening), as
    /proc/net/unix tells anyone local (an accepted connection shows its listener's name)."""
    inodes = _socket_inodes(pid)
    found = []
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]; Type 0001: stream; Flags 0x10000: listening
        if len(fields) == 8 and fields[6] in inodes and fields[4] == "0001" and fields[7].startswith("@"):
            found.append((fields[7], bool(int(fields[3], 16) & 0x10000)))
    return found


_ABSENT = b"\x00absent\x00"  # compare_set's answer for a key that does not exist


class Eavesdropper:
    """Reads each message of a queue the moment it is written, before its consumer deletes it."""

    def __init__(self, port: int, queue: str, first: int = 1, count: int = 200) -> None:
        self.port = port
        self.queue = queue
        self.next = first
        self.count = count
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Reads with a compare-and-set that never matches: it answers the value, or the sentinel
        # once the consumer has deleted it, at once. Between messages the spy blocks in a `wait`,
        # which the server wakes the moment the key is written, rather than spinning (a spinning
        # poll starves the job's own processes of CPU on a loaded host). A timed-out wait leaves
        # torch's client connection out of step, so each timeout opens a fresh one.
        # It follows the queue's head as `tail -f` would: what it cannot keep up with (the job's
        # processes wrote before it started, or the queue's consumer took first) it skips. At
        # the head, a message reserved and not there is either taken already or in flight (its
        # producer writes it in its very next call): looked at once more a moment later, then
        # the spy waits for the one after it, which the server's wake-up lets it read the moment
        # it is written. (Waiting instead on the reserved one, mostly taken already, cost a
        # timed-out wait each time, after which the queue had moved on again: on a loaded host,
        # with the controller taking every message first, the spy heard one in two minutes.)
        store = _client(self.port)
        while not self._stop.is_set() and self.next < self.count:
            key = f"{self.queue}/{self.next}"
            if self._take(store, key):
                continue
            # The counter is read, never `add`ed to: it holds "<index>:<tag>", and an `add` on
            # that breaks the connection.
            reserved = control.parse_counter(control.read(store, f"{self.queue}/n")) or 0
            if reserved > self.next:
                self.next = reserved  # behind: from the newest reserved
                continue
            if reserved == self.next:
                time.sleep(0.02)
                if not self._take(store, key):
                    self.next += 1  # taken before we looked
                key = f"{self.queue}/{self.next}"
            try:
                store.wait([key], datetime.timedelta(seconds=0.5))
            except Exception:  # not written within the wait: a quiet queue
                store = _client(self.port)

    def _take(self, store: dist.TCPStore, key: str) -> bool:
        """Read the message at `key` if it is there (the next one is looked for then)."""
        value = bytes(store.compare_set(key, _ABSENT, _ABSENT))
        if value == _ABSENT:
            return False
        self.seen.append(value)
        self.next += 1
        return True

    def heard(self, n: int, timeout: float) -> bool:
        """Whether the spy has read at least `n` messages within `timeout` seconds.

        It follows the queue like `tail -f` and skips what it cannot keep up with, so on a loaded
        host it may need more of the job's steps than the test has waited for to hear `n`.
        """
        deadline = time.monotonic() + timeout
        while len(self.seen) < n and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.seen) >= n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def test_an_unauthenticated_store_client_can_neither_read_a_secret_nor_control_the_job(tmp_path: Path) -> None:
    run_id = rid("attack")
    run_dir = tmp_path / "runs" / run_id
    proc = start_launch(tmp_path, run_id, "--nnodes", str(NNODES), "--nproc-per-node", "1", "--steps", str(STEPS))
    with stop_at_end(proc) as stopped:
        port = _controller_port(run_dir)
        token = (run_dir / "token").read_text().strip()
        assert len(token) >= 32
        # Listen from the start: the agents' first commands (spawn) carry each rank's environment.
        agents = [Eavesdropper(port, control.agent_queue(n, 0)) for n in range(NNODES)]
        ranks = Eavesdropper(port, control.CTL_QUEUE)
        wait_step(tmp_path / "runs", run_id, 3, timeout=240)
        attacker = _client(port)

        # -- read everything it can name ------------------------------------------------------
        plans = [bytes(attacker.get(k)) for k in (control.gen_plan_key(0), control.GEN_KEY)]
        assert ranks.heard(2 * NNODES, timeout=120), ranks.seen  # the job trains on meanwhile
        for spy in (*agents, ranks):
            spy.stop()
        heard = [m for spy in agents for m in spy.seen]
        spawns = [m for m in heard if b'"kind":"spawn"' in m]
        # It did read a spawn command... Each spy races the agent it spies on for the message
        # (written once, deleted by the agent the moment it has read it): on a loaded host the
        # agent can win one of the races, never both in practice.
        assert spawns, heard
        assert b"FFCTL_RUN_ID" in spawns[0] and b"MASTER_PORT" in spawns[0]
        for value in [*heard, *ranks.seen, *plans]:
            assert token.encode() not in value  # ...and found no token in it, nor anywhere else

        # -- try to control the job -----------------------------------------------------------
        for n in range(NNODES):
            q = control.agent_queue(n, 0)
            control.send_dict(attacker, q, {"type": "kill", "ranks": [n], "grace": 0.0})
            control.send_dict(attacker, q, {"type": "stop"})
            # A genuine spawn replayed (would start rank n twice), or one sealed for the other
            # agent where this one's was not heard: either is refused.
            own = [m for m in spawns if f'"to":"{q}"'.encode() in m]
            idx = attacker.add(f"{q}/n", 1)
            attacker.set(f"{q}/{idx}", (own or spawns)[0])
        for r in range(NNODES):
            control.send_dict(attacker, control.CTL_QUEUE,
                              {"type": "done", "rank": r, "node": r, "gen": 0, "step": STEPS})
        control.send_dict(attacker, control.CTL_QUEUE,
                          {"type": "step", "rank": 0, "node": 0, "gen": 0, "step": STEPS, "loss": 0.0, "dt": 0.1})
        control.send_dict(attacker, control.CTL_QUEUE,
                          {"type": "inject_request", "fault": "kill-node:node=1", "req": "evil", "dry_run": False})
        idx = attacker.add(f"{control.CTL_QUEUE}/n", 1)
        attacker.set(f"{control.CTL_QUEUE}/{idx}", b"\xde\xad\xbe\xef not json at all")
        attacker.set(control.gen_abort_key(0, 0), "1")
        attacker.set(control.gen_plan_key(1), json.dumps(
            {"type": "plan", "gen": 1, "world_size": NNODES, "strategy": "peer", "restore_step": 1,
             "sources": {str(r): {"type": "peer-memory", "address": "127.0.0.1", "port": 1, "where": "replica"}
                         for r in range(NNODES)}}))

        # -- the snapshot channel: the port each agent listens on --------------------------------
        agents_up = [e for e in iter_events(run_dir / "events.jsonl") if e.kind is EventKind.AGENT_STARTED]
        channels = [addr for e in agents_up for addr in _tcp_listeners(int(e.get("pid")))]
        assert len(channels) == NNODES, (agents_up, channels)
        for address, peer_port in channels:
            with socket.create_connection((address, peer_port), timeout=10) as probe:
                assert len(probe.recv(32)) == 32  # the store's challenge
                probe.sendall(b"\x00" * 64)       # no token to answer it with
                assert probe.recv(1) == b""        # hung up on
            with socket.create_connection((address, peer_port), timeout=10) as probe:
                probe.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64)  # not even the protocol
        # ...and the same service on an abstract Unix socket, which nodes on one host stream
        # their copies over: its name is in /proc/net/unix for anyone to see and knock on.
        streams = {int(e.get("node")): _unix_streams(int(e.get("pid"))) for e in agents_up}
        for node, held in streams.items():
            listeners = [name for name, listening in held if listening]
            assert len(listeners) == 1, held
            # Node n's copies arrive from node n-1 over it: an accepted connection of that name.
            assert (listeners[0], False) in held, held
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(10)
                probe.connect(b"\0" + listeners[0][1:].encode())
                assert len(probe.recv(32)) == 32
                probe.sendall(b"\x00" * 64)
                assert probe.recv(1) == b""

        # -- the owner's sealed request is still answered ---------------------------------------
        dry = run_ffctl(tmp_path, "inject", "kill-node", "--run", run_id, "--node", "1", "--dry-run",
                        timeout=60)
        assert dry.returncode == 0, dry.stderr
        assert "kill -KILL" in dry.stdout
        assert not attacker.check(["inject/reply/evil"])  # the unsealed request got no answer

        # The forged `done`s, `stop`s and `kill`s changed nothing: the job trains on until the
        # test stops it (a job that ended on its own would have believed one of them).
        reached = max(int(e.get("step")) for e in iter_events(run_dir / "events.jsonl") if e.kind is EventKind.STEP)
        wait_step(tmp_path / "runs", run_id, reached + 20, timeout=240)
        assert proc.poll() is None
        stopped_at = time.time()
    assert stopped.code == 130, stopped.stderr
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "interrupted"
    assert report["faults"] == []
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    kinds = [e["event"] for e in events]
    assert "failure_detected" not in kinds and "node_lost" not in kinds
    spawned = [e for e in events if e["event"] == EventKind.RANKS_SPAWNED.value]
    assert [e["gen"] for e in spawned] == [0]  # no second generation, no rank started twice
    assert not crashes(list(iter_events(run_dir / "events.jsonl")))
    exits = [e for e in events if e["event"] == EventKind.RANK_EXITED.value]
    assert all(e["t"] >= stopped_at for e in exits), exits  # none was killed before Ctrl-C

    rejected = [e for e in events if e["event"] == EventKind.MESSAGE_REJECTED.value]
    on_ctl = [e for e in rejected if e["queue"] == control.CTL_QUEUE and "reported_by_node" not in e]
    assert len(on_ctl) >= NNODES + 3, rejected  # done x2, step, inject_request, the blob
    assert any("deadbeef" in e["raw"] or "\\xde\\xad" in e["raw"] for e in on_ctl)
    for n in range(NNODES):
        by_agent = [e for e in rejected if e.get("reported_by_node") == n and e["queue"] == control.agent_queue(n, 0)]
        reasons = " | ".join(e["reason"] for e in by_agent)
        # The unsealed kill and stop (too short to hold a MAC, or a wrong one), the replayed spawn
        # (or the other agent's, sealed for that agent's queue).
        own = any(f'"to":"{control.agent_queue(n, 0)}"'.encode() in m for m in spawns)
        assert len(by_agent) == 3 and ("replayed" if own else "sealed for") in reasons, by_agent
    assert report["messages_rejected"] >= len(rejected)  # the report counts what the record holds
    on_channel = [e for e in rejected if e["queue"] == "snapshot channel"]
    assert {e["reported_by_node"] for e in on_channel} == set(range(NNODES)), rejected
    assert all("failed the job-token handshake" in e["reason"] for e in on_channel), on_channel
    assert len(on_channel) == 3 * NNODES, on_channel  # two knocks on the port, one on the socket
    assert sum("the local socket" in e["reason"] for e in on_channel) == NNODES, on_channel
    forged_abort = [e for e in rejected if e["queue"] == control.gen_abort_key(0, 0)]
    assert forged_abort and forged_abort[0].get("reported_by_rank") == 0
    assert_nothing_left(tmp_path)
    assert not shm_left(run_id)
