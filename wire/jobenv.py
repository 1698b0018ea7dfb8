"""What a rank learns from its environment: torchrun's variables plus ffctl's own.

The agent sets these for every rank it spawns (`to_env`); the library reads them back
(`JobEnv.from_env`). torchrun's names are honoured so unchanged torchrun scripts run too.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import ClassVar, Mapping

from runs.events import Label

# Where slots and in-step fault files live: the run's private directory on the rank's host
# (`runs.shm.run_dir`), which only the rank's agent tells it (FFCTL_SHM_DIR, FFCTL_FAULT_DIR).
SHM_DIRS = ("shm_dir", "fault_dir")
# The job token reaches a rank from its agent over the private pipe its assignment comes on, and
# the worker hands it to this module (`hand_token`) before the user's program runs: it is in no
# environment variable the program, its children or anything that logs the environment can see.
# Never through the store either. TOKEN_ENV is still read, for a rank started by other means.
TOKEN_ENV = "FFCTL_TOKEN"
_handed_token: list[str] = []
# torchrun's per-rank error file: torch's `@record` writes a failing rank's exception there, and
# the agent reads it when the rank exits (the root cause's message).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def hand_token(token: str) -> None:
    """Give this process the job token (the worker does, from its assignment), and take it out
    of the environment if it was there."""
    _handed_token[:] = [token]
    os.environ.pop(TOKEN_ENV, None)


def job_token(environ: Mapping[str, str] | None = None) -> str:
    """The job token this process was handed, else TOKEN_ENV of `environ` (default: ours)."""
    if _handed_token and environ is None:
        return _handed_token[0]
    return (os.environ if environ is None else environ).get(TOKEN_ENV, "")


class Strategy(Label):
    """Recovery strategies (DESIGN.md): values of `--recovery`. `Strategy.ALL` lists the values,
    in the order help texts show them."""

    PEER = "peer"
    RESTART_MEMORY = "restart-memory"
    RESTART_DISK = "restart-disk"
    NONE = "none"

    ALL: ClassVar[tuple[str, ...]]


# Set after the class: assigned inside its body it would be a member.
Strategy.ALL = tuple(s.value for s in Strategy)


@dataclass(frozen=True)
class JobEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int
    run_id: str
    store_host: str
    store_port: int
    gen: int
    strategy: str = Strategy.PEER
    shm_dir: str = ""
    ckpt_dir: str = ""
    ckpt_every: int = 0
    # Memory snapshot slots per rank, used in turn (`step % slots`): 2, the newest two steps; 3
    # under --verify-restore, so a recovery can go one step further back and replay.
    slots: int = 2
    replicate: bool = False  # wait for the ring neighbour's copy before the next update
    token: str = ""
    pg_timeout: float = 60.0
    backend: str = "gloo"
    fault_dir: str = ""
    role: str = "default"  # torchrun's --role
    max_restarts: int = 0  # the job's restart budget, as torchrun tells its workers
    # MASTER_PORT when it is not the control store's: an unchanged script's rendezvous store,
    # one per generation (see ffctl.controller.plane.ControlPlane.rendezvous_port).
    master_port: int = 0

    @property
    def memory_snapshots(self) -> bool:
        return self.strategy in (Strategy.PEER, Strategy.RESTART_MEMORY)

    def to_env(self) -> dict[str, str]:
        env = {f"FFCTL_{k.upper()}": str(int(v) if isinstance(v, bool) else v) for k, v in asdict(self).items()}
        if not self.token:
            del env[TOKEN_ENV]  # the agent adds it where the rank starts
        for name in SHM_DIRS:
            if not getattr(self, name):
                del env[f"FFCTL_{name.upper()}"]  # so does it the run's directory on its host
        env.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size), GROUP_RANK=str(self.node),
            # torchrun's node count (every node runs the same number of ranks).
            GROUP_WORLD_SIZE=str(self.world_size // max(1, self.local_world_size)),
            ROLE_RANK=str(self.rank), ROLE_WORLD_SIZE=str(self.world_size), ROLE_NAME=self.role,
            MASTER_ADDR=self.store_host, MASTER_PORT=str(self.master_port or self.store_port),
            TORCHELASTIC_RUN_ID=self.run_id, TORCHELASTIC_RESTART_COUNT=str(self.gen),
            TORCHELASTIC_MAX_RESTARTS=str(self.max_restarts),
            # torch's env:// rendezvous then joins the store as a client, as under torchrun's
            # agent, which hosts a new store for each restart round (so does ffctl).
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(f"FFCTL_{f.name.upper()}")
            if raw is None:
                continue
            if f.type in ("int", int):
                values[f.name] = int(raw)
            elif f.type in ("float", float):
                values[f.name] = float(raw)
            elif f.type in ("bool", bool):
                values[f.name] = raw not in ("0", "", "false", "False")
            else:
                values[f.name] = raw
        missing = [n for n in ("rank", "world_size", "run_id", "store_host", "store_port") if n not in values]
        if missing:
            raise RuntimeError(
                "not started by ffctl: missing " + ", ".join(f"FFCTL_{m.upper()}" for m in missing)
            )
        if environ is None and _handed_token:
            values["token"] = _handed_token[0]
        values.setdefault("local_rank", int(env.get("LOCAL_RANK", 0)))
        values.setdefault("local_world_size", int(env.get("LOCAL_WORLD_SIZE", 1)))
        values.setdefault("node", int(env.get("GROUP_RANK", 0)))
        values.setdefault("gen", int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
        return cls(**values)  # type: ignore[arg-type]
