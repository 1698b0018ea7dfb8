"""`LaunchSpec`: everything `ffctl launch` was asked to do, validated before anything starts.

A loose module of `ffctl/` (like `errors`): the launch plans it, the controller runs it and the
hosts' backend reshapes it, so it lives where all three may import it. Every check of a launch is
here, the built-in workload's model and optimizer names taken from its own table.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from wire.fault_spec import MAX_DURATION_S, MAX_SEED, FaultKind, FaultSpec, FaultSpecError
from fault_injectors.targets import check_in_job
from wire.jobenv import Strategy
from wire.messages import MAX_COPIES
from ffctl.agent.stepscan import StepRegexError, compile_step_regex
from ffctl.workload.sizes import MODELS, OPTIMIZERS, PARALLELISMS
from runs.store import RunStoreError, validate_run_id

# Upper bounds a machine sets, far above any real job but low enough that a typo (an extra zero,
# a pasted id) is refused rather than attempted.
MAX_NODES = 1024
MAX_PROCS_PER_NODE = 1024  # ranks per node; warm spares per node too
MAX_STEPS = 1_000_000_000
MAX_BATCH = 1 << 20
# Restarts allowed when none is asked for: torchrun's 0 for an unchanged script; a job on the
# recovery library keeps ffctl's 3 (see ffctl.controller.coordinator).
PLAIN_MAX_RESTARTS = 0
LIBRARY_MAX_RESTARTS = 3
# What a worker given with torchrun's --no-python runs (it replaces itself with the program).
EXEC_MODULE = "ffctl.agent.execprog"
SANDBOXES = ("netns",)  # --sandbox values (ffctl.backends.BACKENDS has one backend each)
# --backend values: local processes, the netns sandbox (as --sandbox netns), Slurm job steps.
BACKEND_NAMES = ("local", "netns", "slurm")


class SpecError(ValueError):
    """Bad input: the message is one line naming the bad value (exit code 2)."""


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(flag: str, value: object, low: int, high: int) -> None:
    # bool is an int to Python, never to a user: `nnodes = true` is refused.
    if not isinstance(value, int) or isinstance(value, bool):
        raise SpecError(f"{flag} {_shown(value)}: not a whole number")
    if not low <= value <= high:
        raise SpecError(f"{flag} {value}: must be between {low} and {high}")


def _seconds(flag: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SpecError(f"{flag} {_shown(value)}: not a number of seconds")
    # nan compares false with everything: the range test alone would let it through.
    if not math.isfinite(value) or not 0 < value <= MAX_DURATION_S:
        raise SpecError(f"{flag} {value:g}: must be more than 0 and at most {MAX_DURATION_S:g} seconds")


# --straggler replace: how many times the others' median busy time a rank must take, and for how
# many steps in a row, before it is treated as failed and replaced.
STRAGGLER_FACTOR = 2.0
STRAGGLER_STEPS = 3


@dataclass(frozen=True)
class StragglerPolicy:
    """What the controller does about a straggler it detects (`--straggler`): `wait` records it
    and bills its lost time; `replace` also treats a rank slower than `factor` times the median
    for `steps` steps in a row as failed, and replaces it through the normal recovery path."""

    action: str = "wait"  # "wait" | "replace"
    factor: float = STRAGGLER_FACTOR
    steps: int = STRAGGLER_STEPS

    @property
    def replaces(self) -> bool:
        return self.action == "replace"

    def __str__(self) -> str:
        return "wait" if not self.replaces else f"replace:factor={self.factor:g},steps={self.steps}"


def parse_straggler(text: str) -> StragglerPolicy:
    """`wait`, or `replace[:factor=F][,steps=N]` (F above 1, N from 1 to 100); a bad value is
    SpecError naming it."""
    bad = f"--straggler {_shown(text)}"
    action, _, rest = text.partition(":")
    if action == "wait" and not rest:
        return StragglerPolicy()
    if action != "replace":
        raise SpecError(f"{bad}: use wait or replace[:factor=F][,steps=N]")
    factor, steps = STRAGGLER_FACTOR, STRAGGLER_STEPS
    seen: set[str] = set()
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in ("factor", "steps") or key in seen:
            raise SpecError(f"{bad}: {_shown(part)} is not factor=F or steps=N (each at most once)")
        seen.add(key)
        if key == "factor":
            try:
                factor = float(value) if value.isascii() else math.nan
            except ValueError:
                factor = math.nan
            if not (math.isfinite(factor) and 1.0 < factor <= 100.0):
                raise SpecError(f"{bad}: factor={_shown(value)} must be a number above 1 (at most 100)")
        else:
            if not (value.isascii() and value.isdigit() and 1 <= int(value) <= 100):
                raise SpecError(f"{bad}: steps={_shown(value)} must be a whole number from 1 to 100")
            steps = int(value)
    return StragglerPolicy("replace", factor, steps)


@dataclass(frozen=True)
class LaunchSpec:
    nnodes: int = 2
    nproc_per_node: int = 2
    steps: int = 60  # the built-in GPT's; a script trains as many as it does itself
    seed: int = 0
    model: str = "tiny"
    optimizer: str = "adamw"  # built-in workload: adamw (replicated) or sharded (ZeRO-1)
    parallel: str = "ddp"  # built-in workload: ddp, fsdp or hsdp (torch's fully_shard)
    batch: int = 0  # built-in workload: sequences per rank per step (0: the model size's default)
    recovery: str = Strategy.PEER
    ckpt_every: int = 0
    spares: int = 0
    # Recoveries from failures ffctl did not inject (see ffctl.controller.coordinator). None: the
    # worker's default, torchrun's 0 for an unchanged script and 3 for the recovery library.
    max_restarts: int | None = None
    injects: tuple[FaultSpec, ...] = ()
    chaos: str | None = None
    run_id: str | None = None
    runs_dir: Path = Path("ffctl-runs")
    script: tuple[str, ...] = ()  # user script and its args; empty = built-in GPT
    sandbox: str | None = None
    backend: str | None = None  # --backend (None: local, --sandbox's or --hosts')
    hostfile: Path | None = None
    accept_new_host_keys: bool = False
    master_addr: str | None = None  # --master-addr: the store's address for multi-host runs
    remote_python: str = "python3"  # the interpreter agents are started with on the hosts
    remote_runs_dir: str = "/tmp/ffctl-runs"  # per-run files (logs, checkpoints) on the hosts
    heartbeat_timeout: float = 1.0
    hang_min_s: float = 5.0
    pg_timeout: float = 120.0
    # How long ranks may keep running once others of their generation finished (exit 0): then
    # they are stopped and the run fails naming them. torchrun's agent waits 300 s at its exit
    # barrier.
    exit_barrier_timeout: float = 300.0
    # How long a script's job may go with no rank printing a line or committing a step (no
    # rank has exited, so the exit barrier has not started) before it is stopped as hung, each
    # rank's stacks kept. torchrun has no such limit; NVRx's rank heartbeat is the nearest.
    silence_timeout: float = 1800.0
    # Run even though a requested fault can never fire, and exit 0 when one never took effect:
    # the fault is recorded as missed either way (`fault_missed`).
    allow_missed: bool = False
    address: str = "127.0.0.1"  # where the controller's store listens
    extra_env: tuple[tuple[str, str], ...] = field(default=())
    keep_freed_memory: bool = True  # workers keep freed memory rather than fault it in each step
    role: str = "default"  # torchrun's --role: the workers' ROLE_NAME
    # torchrun options accepted and recorded (name, value), which ffctl's controller and agents
    # carry out their own way (ffctl.launch.torchrun.RECORDED).
    torchrun: tuple[tuple[str, str], ...] = ()
    # A script's steps read off its output (ffctl.agent.stepscan), for one that prints them but
    # does not call `recovery.report_step`.
    step_regex: str | None = None
    # --straggler: wait (default) or replace:factor=F (`parse_straggler`)
    straggler: str = "wait"
    # --verify-restore: a memory recovery restores one snapshot further back than it could and
    # trains the steps in between again; every rank's loss of each must equal, bit for bit, what
    # it reported before the fault, or the job stops (state the script does not register).
    verify_restore: bool = False
    # --snapshot-copies K: each node's snapshots held by the next K nodes on the ring (1: the
    # neighbour alone), so that K nodes lost together still leave a copy in memory.
    snapshot_copies: int = 1

    @property
    def snapshot_slots(self) -> int:
        """Memory snapshot slots per rank: a third under --verify-restore, so that the ranks a
        fault left one step ahead still hold the step before the lost rank's newest."""
        return 3 if self.verify_restore else 2

    @property
    def straggler_policy(self) -> StragglerPolicy:
        return parse_straggler(self.straggler)

    @property
    def last_step(self) -> int | None:
        """The job's last step where ffctl knows it: the built-in GPT's --steps (a script's own
        loop decides how long it trains)."""
        return None if self.script else self.steps

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    @property
    def worker_template(self) -> bool:
        """Whether workers are forked from a warm template: not under restart-disk, which stays
        what torchrun users have (every worker a fresh interpreter, the honest baseline)."""
        return self.recovery != Strategy.RESTART_DISK

    def validate(self) -> LaunchSpec:
        """Every field in range, whoever built the spec (CLI, scenario file, a library caller)."""
        _whole("--nnodes", self.nnodes, 1, MAX_NODES)
        _whole("--nproc-per-node", self.nproc_per_node, 1, MAX_PROCS_PER_NODE)
        _whole("--steps", self.steps, 1, MAX_STEPS)
        _whole("--seed", self.seed, 0, MAX_SEED)
        if self.model not in MODELS:
            raise SpecError(f"--model {_shown(self.model)}: use {', '.join(MODELS)}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"--optimizer {_shown(self.optimizer)}: use {' or '.join(OPTIMIZERS)}")
        if self.parallel not in PARALLELISMS:
            raise SpecError(f"--parallel {_shown(self.parallel)}: use {', '.join(PARALLELISMS)}")
        if self.parallel != "ddp" and self.optimizer == "sharded":
            raise SpecError(f"--parallel {self.parallel} shards the optimizer state itself: leave --optimizer adamw")
        if self.parallel == "hsdp" and (self.nnodes < 2 or self.nproc_per_node < 2):
            raise SpecError(f"--parallel hsdp needs at least 2 nodes of 2 ranks (replicas across nodes, shards "
                            f"within one), not {self.nnodes} x {self.nproc_per_node}")
        if not isinstance(self.recovery, str) or self.recovery not in Strategy.ALL:
            raise SpecError(f"--recovery {_shown(self.recovery)}: use one of {', '.join(Strategy.ALL)}")
        _whole("--ckpt-every", self.ckpt_every, 0, MAX_STEPS)
        if self.recovery == Strategy.RESTART_DISK and self.ckpt_every == 0:
            raise SpecError("--recovery restart-disk needs --ckpt-every N (N >= 1)")
        _seconds("--heartbeat-timeout", self.heartbeat_timeout)
        _seconds("--hang-timeout", self.hang_min_s)
        parse_straggler(self.straggler)
        _seconds("pg_timeout", self.pg_timeout)
        _seconds("--exit-barrier-timeout", self.exit_barrier_timeout)
        _seconds("--silence-timeout", self.silence_timeout)
        _whole("--batch", self.batch, 0, MAX_BATCH)
        _whole("--spares", self.spares, 0, MAX_PROCS_PER_NODE)
        _whole("--snapshot-copies", self.snapshot_copies, 1, MAX_COPIES)
        if self.snapshot_copies > 1 and self.snapshot_copies >= self.nnodes:
            raise SpecError(f"--snapshot-copies {self.snapshot_copies}: the copies sit on other nodes, and "
                            f"{self.nnodes} node(s) have {self.nnodes - 1} others")
        if self.max_restarts is not None:
            _whole("--max-restarts", self.max_restarts, 0, MAX_STEPS)
        if self.step_regex is not None:
            if not self.script:
                raise SpecError(f"--step-regex {_shown(self.step_regex)}: only for a script (the built-in GPT "
                                "reports its steps itself)")
            try:
                compile_step_regex(self.step_regex)
            except StepRegexError as exc:
                raise SpecError(str(exc)) from None
        if self.run_id is not None:
            try:
                validate_run_id(self.run_id)
            except RunStoreError as exc:
                raise SpecError(f"--run-id: {exc}") from None
        if self.sandbox is not None and self.sandbox not in SANDBOXES:
            raise SpecError(f"--sandbox {_shown(self.sandbox)}: the only sandbox is {SANDBOXES[0]!r}")
        if self.backend is not None and self.backend not in BACKEND_NAMES:
            raise SpecError(f"--backend {_shown(self.backend)}: one of {', '.join(BACKEND_NAMES)}")
        if self.backend == "slurm" and (self.hostfile is not None or self.sandbox is not None):
            raise SpecError("--backend slurm runs nodes as Slurm job steps: give it without --hosts and --sandbox")
        drains = [str(f) for f in self.injects if f.option("drain") == "yes"]
        if drains and self.backend != "slurm":
            raise SpecError(f"--inject {drains[0]}: drain=yes drains a Slurm node; it needs --backend slurm")
        if self.sandbox is not None and self.hostfile is not None:
            raise SpecError(f"--sandbox {self.sandbox} and --hosts {self.hostfile}: the sandbox is for nodes on this "
                            "machine; give one or the other")
        if self.hostfile is not None and not (isinstance(self.remote_runs_dir, str) and self.remote_runs_dir.startswith("/")):
            raise SpecError(f"--remote-runs-dir {_shown(self.remote_runs_dir)}: must be an absolute path")
        if self.script and not self.script[0].startswith("-m") and not os.path.isfile(self.script[0]):
            raise SpecError(f"script {self.script[0]!r} does not exist")
        for spec in self.injects:
            # --steps is the built-in GPT's length; a script's steps are its own (it reports
            # them), so a step trigger in a script is bounded only by the fault parser's limit.
            if spec.trigger.step is not None and not self.script and spec.trigger.step > self.steps:
                raise SpecError(f"--inject {spec.kind.value} at step {spec.trigger.step}: the run has only {self.steps} steps")
            # A spec built in code skips the parser: nan would reach the dead man's switch's sleep.
            if spec.duration is not None and not (math.isfinite(spec.duration) and 0 < spec.duration <= MAX_DURATION_S):
                raise SpecError(f"--inject {spec.kind.value} duration {spec.duration!r}: must be more than 0 "
                                f"and at most {MAX_DURATION_S:g} seconds")
            if spec.trigger.t is not None and not (math.isfinite(spec.trigger.t) and spec.trigger.t >= 0):
                raise SpecError(f"--inject {spec.kind.value} t={spec.trigger.t!r}: must be a finite time after the start")
            try:
                check_in_job(spec, self.world_size, self.nnodes)
            except FaultSpecError as exc:
                raise SpecError(f"--inject {spec.kind.value}: {exc}") from None
            why = self._pointless(spec)
            if why:
                raise SpecError(f"--inject {spec.to_text()}: {why}")
        if self.master_addr is not None and self.master_addr.strip() in ("0.0.0.0", "::", "[::]", "*"):
            # torchrun's MASTER_ADDR is where workers reach the store, not what it binds: ffctl
            # never listens on every interface, and no worker can connect to "any".
            raise SpecError(f"--master-addr {self.master_addr}: give the address the hosts reach the store at, "
                            "not every interface")
        if self.verify_restore and self.recovery == Strategy.NONE:
            raise SpecError("--verify-restore checks recoveries from memory, and --recovery none makes none")
        return self

    def _pointless(self, spec: FaultSpec) -> str | None:
        """Why a fault could test nothing in this job (None when it can): asked for, it would
        pass a chaos check without a word."""
        if spec.kind is FaultKind.CORRUPT_SNAPSHOT:
            if self.recovery not in (Strategy.PEER, Strategy.RESTART_MEMORY):
                return f"snapshots in memory are corrupted, and --recovery {self.recovery} never reads them"
            if spec.option("copy") == "replica" and self.nnodes < 2:
                return "copy=replica corrupts the copies other nodes hold, and this job has one node"
        if spec.kind is FaultKind.KILL_NODE and self.nnodes < 2 and self.backend != "slurm":
            return "the job's only node: no survivor holds its state and nothing can take its place"
        if spec.option("phase") == "backward" and not self.script and (self.optimizer == "sharded"
                                                                        or self.parallel != "ddp"):
            # The phase is DDP's gradient hook (`recovery.job.Job._phase_hooks`); the sharded
            # optimizer reduces its own gradients and FSDP's backward is its first collective.
            how = "--optimizer sharded" if self.optimizer == "sharded" else f"--parallel {self.parallel}"
            return f"the built-in GPT with {how} has no DDP backward for it to land in (use phase=collective)"
        return None
