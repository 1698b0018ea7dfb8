"""The host template against real processes: it forks agents whose worker templates are warm
forks too, reports every exit (an agent stopped, killed, or the last one), survives a line it
cannot read, and its agents stop in order when it goes."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from ffctl.agent.config import AgentConfig
from ffctl.agent.workerenv import worker_env
from ffctl.backends.host_template import ForkedAgent, HostTemplate
from tests.helpers.netns import wait_for

# A real host template (torch imported) in each test.
pytestmark = pytest.mark.timeout(300)


# The agents' environment, as the controller's would be: one that does not change between starts
# (pytest's PYTEST_CURRENT_TEST does, and a worker template is forked only for the environment
# the host template warmed up with).
BASE = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}


def _standby(tmp_path: Path, node: int) -> str:
    # A spare node's agent: it warms its worker template, then waits on its stdin for the node's
    # config, needing no controller; EOF (StopAgent, or the template gone) ends it with status 0.
    return AgentConfig(run_id="ht", node=node, nnodes=2, store_host="127.0.0.1", store_port=1, address="127.0.0.1",
                       token="t" * 32, log_dir=str(tmp_path / str(node)), worker_argv=("-m", "ffctl.workload.train"),
                       standby=True).to_json()


def _worker_templates(agent: ForkedAgent) -> list[psutil.Process]:
    def ready() -> list[psutil.Process]:
        return [c for c in psutil.Process(agent.pid).children()]
    assert wait_for(lambda: bool(ready()), 60.0)
    return ready()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[HostTemplate]:
    cfg = AgentConfig.from_json(_standby(tmp_path, 0))
    template = HostTemplate(sys.executable, worker_env(BASE, cfg.worker_env, cfg.keep_freed_memory),
                            str(tmp_path), tmp_path / "host-template.log")
    template.start()
    yield template
    template.close()


def test_agents_are_forked_warm_and_every_exit_is_reported(host: HostTemplate, tmp_path: Path) -> None:
    assert host.wait_ready(), (tmp_path / "host-template.log").read_text()
    assert host.proc is not None
    agents = [host.start_agent(BASE, str(tmp_path), tmp_path / f"agent-{n}.log", _standby(tmp_path, n))
              for n in (0, 1, 2)]
    assert all(a is not None for a in agents), (tmp_path / "host-template.log").read_text()
    a, b, c = (x for x in agents if x is not None)
    for agent in (a, b, c):
        assert psutil.Process(agent.pid).ppid() == host.proc.pid
        # Its worker template is its own fork (the host template's command line), not a fresh
        # `python -m ffctl.agent.template` importing torch again.
        (template,) = _worker_templates(agent)
        assert "ffctl.agent.host_template" in " ".join(template.cmdline())
        assert agent.poll() is None

    # A line the template cannot read is reported in its log and changes nothing.
    assert host.proc.stdin is not None
    host.proc.stdin.write(b'{"type": "start_agent", "id": "x"}\nnot json\n')
    host.proc.stdin.flush()

    # Stopped (EOF on its stdin): it exits 0, and that exit is reported, the last agent's too;
    # an exit not reported would leave `stop` to SIGKILL it after its deadline.
    a.stop(timeout=60.0)
    assert a.returncode == 0, (tmp_path / "agent-0.log").read_text()
    os.kill(b.pid, signal.SIGKILL)
    assert wait_for(lambda: b.poll() is not None, 60.0) and b.returncode == -signal.SIGKILL
    c.stop(timeout=60.0)
    assert c.returncode == 0, (tmp_path / "agent-2.log").read_text()
    assert "unreadable" not in (tmp_path / "host-template.log").read_text()
    assert "bad request" in (tmp_path / "host-template.log").read_text()

    # Still serving after the garbage; and an agent it forked stops on its own when it goes.
    d = host.start_agent(BASE, str(tmp_path), tmp_path / "agent-3.log", _standby(tmp_path, 3))
    assert d is not None
    (template,) = _worker_templates(d)
    host.close()
    assert wait_for(lambda: not psutil.pid_exists(d.pid) or psutil.Process(d.pid).status() == psutil.STATUS_ZOMBIE,
                    60.0)
    assert wait_for(lambda: not psutil.pid_exists(template.pid), 60.0)


def test_a_template_that_cannot_start_means_agents_started_the_ordinary_way(tmp_path: Path) -> None:
    template = HostTemplate(str(tmp_path / "no-such-python"), {}, str(tmp_path), tmp_path / "log")
    template.start()
    assert template.start_agent(BASE, str(tmp_path), tmp_path / "agent.log", _standby(tmp_path, 0)) is None
    assert "not started" in (tmp_path / "log").read_text()
    template.close()
    gone = HostTemplate(sys.executable, {**os.environ, "PYTHONPATH": str(tmp_path)}, str(tmp_path), tmp_path / "log2")
    (tmp_path / "ffctl").mkdir()
    (tmp_path / "ffctl" / "__init__.py").write_text("raise SystemExit(3)\n")  # the module cannot load
    gone.start()
    try:
        assert not gone.wait_ready(60.0)
        assert gone.start_agent(BASE, str(tmp_path), tmp_path / "agent.log", _standby(tmp_path, 0)) is None
    finally:
        gone.close()
