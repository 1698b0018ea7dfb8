"""The node agent's configuration: what a backend starts an agent with, and how.

The controller and every node backend build an `AgentConfig` and start `agent_argv(python)`;
they import this module only, never the agent's runtime (`ffctl.agent.agent`), so that starting
agents costs no import of what runs inside one. Nothing heavy is imported here.
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field

# Seconds a worker being stopped gets between SIGTERM and SIGKILL when the launch does not say.
TERM_GRACE_S = 5.0
# The AgentConfig JSON when it cannot come as the first stdin line (agents started over SSH).
CONFIG_ENV = "FFCTL_AGENT_CONFIG"


def agent_argv(python: str) -> list[str]:
    """How every backend starts an agent (its config then comes on stdin or in CONFIG_ENV); the
    launch's dry run prints this very argv."""
    return [python, "-m", "ffctl.agent"]


@dataclass(frozen=True)
class AgentConfig:
    run_id: str
    node: int
    nnodes: int
    store_host: str
    store_port: int
    address: str  # where this node's snapshot store listens (never all interfaces)
    token: str
    log_dir: str
    worker_argv: tuple[str, ...]  # ("-m", "ffctl.workload.train", ...) or (script, args...)
    worker_env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    cwd: str = ""
    # The run's private shared-memory directory on this host (`runs.shm.run_dir`), named by the
    # controller and made by the first agent of the host; empty: the agent draws one itself.
    shm_dir: str = ""
    spares: int = 0
    incarnation: int = 0
    keep_freed_memory: bool = True  # see ffctl.agent.workerenv
    # Fork workers from a warm template process (ffctl.agent.template); False starts every
    # worker as a fresh interpreter, as torchrun does (the honest `restart-disk` baseline).
    template: bool = True
    # A script's steps read off its output (ffctl.agent.stepscan); empty: none are.
    step_regex: str = ""
    snapshot_slots: int = 2  # per rank (wire.jobenv.JobEnv.slots)
    # Seconds a worker being stopped gets between SIGTERM and SIGKILL (torchrun's --shutdown-timeout).
    term_grace: float = TERM_GRACE_S
    # A spare node's agent (`stand_by`): this config only warms a worker template; the node's own
    # config comes as the next stdin line when a lost node moves there.
    standby: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> AgentConfig:
        raw = json.loads(text)
        raw["worker_argv"] = tuple(raw["worker_argv"])
        return cls(**raw)
