"""The sshd helper itself: a cluster whose pytest was SIGKILLed is swept by the next one built.

A killed test run cannot run its teardown, and namespaces, veths, a bridge and an sshd would
otherwise outlive it on a shared CI machine. The builder here is a real child process killed with
SIGKILL while its cluster is up; `sweep_abandoned` must leave nothing of that cluster, and must not
touch a cluster whose builder still lives.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.sshd import checked_sshd_cluster, leftovers, skip_reason, sweep_abandoned

# A private sshd cluster in network namespaces is built and swept.
pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]

BUILDER = """
import time
from tests.helpers.sshd import sshd_cluster
with sshd_cluster(1) as cluster:
    print(cluster.uid, flush=True)
    time.sleep(600)
"""

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_a_cluster_whose_builder_was_sigkilled_is_swept_and_a_live_one_is_not() -> None:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER], cwd=REPO, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        uid = (builder.stdout.readline() if builder.stdout else "").strip()
        assert uid, "the builder never reported its cluster"
        with checked_sshd_cluster(1) as live:  # sweeps nothing yet: the builder lives
            assert leftovers(uid), "the builder's cluster should be up"
            os.kill(builder.pid, signal.SIGKILL)
            builder.wait(timeout=30)
            assert leftovers(uid), "SIGKILL runs no teardown"
            assert uid in sweep_abandoned()
            assert leftovers(uid) == []
            assert leftovers(live.uid) != []  # its builder (this test) is alive: untouched
            assert live.netns_run(live.hosts[0], ["true"]).returncode == 0
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait(timeout=30)
        sweep_abandoned()
