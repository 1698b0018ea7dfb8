"""`LaunchSpec`: everything `ffctl launch` was asked to do, validated before anything starts."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from fault_injectors.spec import FaultSpec
from recovery.jobenv import Strategy


class SpecError(ValueError):
    """Bad input: the message is one line naming the bad value (exit code 2)."""


@dataclass(frozen=True)
class LaunchSpec:
    nnodes: int = 2
    nproc_per_node: int = 2
    steps: int = 60
    seed: int = 0
    model: str = "tiny"
    optimizer: str = "adamw"  # built-in workload: adamw (replicated) or sharded (ZeRO-1)
    batch: int = 0  # built-in workload: sequences per rank per step (0: the model size's default)
    recovery: str = Strategy.PEER
    ckpt_every: int = 0
    spares: int = 0
    max_restarts: int = 3  # recoveries from failures ffctl did not inject (see ffctl.coordinator)
    injects: tuple[FaultSpec, ...] = ()
    chaos: str | None = None
    run_id: str | None = None
    runs_dir: Path = Path("ffctl-runs")
    script: tuple[str, ...] = ()  # user script and its args; empty = built-in GPT
    sandbox: str | None = None
    hostfile: Path | None = None
    accept_new_host_keys: bool = False
    master_addr: str | None = None  # --master-addr: the store's address for multi-host runs
    remote_python: str = "python3"  # the interpreter agents are started with on the hosts
    remote_runs_dir: str = "/tmp/ffctl-runs"  # per-run files (logs, checkpoints) on the hosts
    heartbeat_timeout: float = 1.0
    hang_min_s: float = 5.0
    pg_timeout: float = 120.0
    address: str = "127.0.0.1"  # where the controller's store listens
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    keep_freed_memory: bool = True  # workers keep freed memory rather than fault it in each step

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def validate(self) -> LaunchSpec:
        if self.nnodes < 1:
            raise SpecError(f"--nnodes {self.nnodes}: must be at least 1")
        if self.nproc_per_node < 1:
            raise SpecError(f"--nproc-per-node {self.nproc_per_node}: must be at least 1")
        if self.steps < 1:
            raise SpecError(f"--steps {self.steps}: must be at least 1")
        if self.recovery not in Strategy.ALL:
            raise SpecError(f"--recovery {self.recovery!r}: use one of {', '.join(Strategy.ALL)}")
        if self.ckpt_every < 0:
            raise SpecError(f"--ckpt-every {self.ckpt_every}: must not be negative")
        if self.recovery == Strategy.RESTART_DISK and self.ckpt_every == 0:
            raise SpecError("--recovery restart-disk needs --ckpt-every N (N >= 1)")
        if self.hang_min_s <= 0:
            raise SpecError(f"--hang-timeout {self.hang_min_s:g}: must be positive")
        if self.batch < 0:
            raise SpecError(f"--batch {self.batch}: must not be negative")
        if self.spares < 0:
            raise SpecError(f"--spares {self.spares}: must not be negative")
        if self.max_restarts < 0:
            raise SpecError(f"--max-restarts {self.max_restarts}: must not be negative")
        if self.script and not self.script[0].startswith("-m") and not os.path.isfile(self.script[0]):
            raise SpecError(f"script {self.script[0]!r} does not exist")
        for spec in self.injects:
            if spec.trigger.step is not None and spec.trigger.step > self.steps:
                raise SpecError(f"--inject {spec.kind.value} at step {spec.trigger.step}: the run has only {self.steps} steps")
        return self
