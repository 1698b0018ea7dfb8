"""`AgentProcess.running_here` for the local backend, on real processes: an agent of this host
and network that runs (or sleeps) vouches for its silence; stopped, ended, or in a network
namespace of its own (where a link can be cut) it does not."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from ffctl.backends.children import running
from ffctl.backends.local import LocalAgent


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


def test_a_local_agent_runs_here_until_it_is_stopped_or_ends(tmp_path: Path) -> None:
    proc = _child()
    log = open(tmp_path / "agent.log", "ab")
    agent = LocalAgent(proc, log)
    try:
        assert agent.running_here() and running(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        # The stop takes effect asynchronously; the kernel shows it within moments.
        for _ in range(200):
            if not agent.running_here():
                break
            subprocess.run(["sleep", "0.01"])
        assert not agent.running_here()
        proc.send_signal(signal.SIGCONT)
        for _ in range(200):
            if agent.running_here():
                break
            subprocess.run(["sleep", "0.01"])
        assert agent.running_here()
        with open(tmp_path / "other.log", "ab") as other:
            # In a namespace of its own a cut link looks the same as a hung agent.
            assert not LocalAgent(proc, other, netns="ffctl-n1").running_here()
    finally:
        agent.stop(10.0)
    assert proc.poll() is not None and not agent.running_here()
