"""Slurm job steps: how the Slurm node backend runs agents and fault commands on its nodes.

Every command on a Slurm node is a one-task step of the job (`step_argv`: ``srun --jobid J
--nodes 1 --ntasks 1 --nodelist HOST --overlap --kill-on-bad-exit ...``). A `SlurmStep` is the
controller's handle on a node's agent step (its config the first line of the step's stdin,
which stays open for the agent's lifetime); `SlurmTransport` runs a fault's command as a step of
its own; `StepKill` is kill-node the Slurm way, the agent step cancelled with SIGKILL
(``scancel --signal=KILL J.S``; scancel may print an error for a step yet kill it, so the step's
end is what is checked).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import IO, Mapping, Sequence

from fault_injectors.transport import CommandResult
from ffctl.agent.config import agent_argv as agent_command
from ffctl.backends.children import stop_process
from ffctl.backends.slurm_cluster import COMMAND_TIMEOUT_S, Runner, allocation

# How long a cancelled step may take to end before the launch says it could not stop it.
STEP_END_S = 15.0


def step_argv(job: str, host: str, name: str, argv: Sequence[str]) -> list[str]:
    """`argv` as a one-task step of job `job` on `host`, sharing the allocation's resources with
    the batch step and the other steps (``--overlap``); a task that fails ends its step."""
    return ["srun", f"--jobid={job}", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap",
            "--kill-on-bad-exit=1", "--cpu-bind=none", f"--job-name={name}", "--quiet", *argv]


def agent_argv(job: str, host: str, name: str, python: str = sys.executable) -> list[str]:
    """The step that runs a node's agent (its config is the first line of the step's stdin)."""
    return step_argv(job, host, name, agent_command(python))


def cancel_argv(step: str, signal: str | None = None) -> list[str]:
    """``scancel [--signal=SIG] JOB.STEP``."""
    return ["scancel", *([f"--signal={signal}"] if signal else []), step]


# --------------------------------------------------------------------------------------------
# steps


class SlurmStep:
    """The controller's handle on one agent step: the local `srun` and the step it made."""

    pid = 0  # the agent's pid on its node is not known here (it reports it itself)

    def __init__(self, proc: subprocess.Popen[bytes], job: str, name: str, host: str, log: IO[bytes],
                 run: Runner = subprocess.run) -> None:
        self.proc = proc
        self.job = job
        self.name = name
        self.host = host
        self._log = log
        self._run = run
        self._step: str | None = None

    def poll(self) -> int | None:
        return self.proc.poll()

    def running_here(self) -> bool:
        return False  # a step on a Slurm node, across a link: its silence is all we have

    def step_id(self, wait_s: float = 5.0) -> str | None:
        """``JOB.STEP`` of this step, found by its unique name in ``squeue --steps``."""
        deadline = time.monotonic() + wait_s
        while self._step is None:
            try:
                out = self._run(["squeue", "--steps", f"--jobs={self.job}", "--noheader", "--format=%i %j"],
                                capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
                for line in out.stdout.splitlines():
                    words = line.split()
                    if len(words) == 2 and words[1] == self.name:
                        self._step = words[0]
            except (OSError, subprocess.TimeoutExpired):
                pass
            if self._step is not None or time.monotonic() >= deadline or self.proc.poll() is not None:
                break
            time.sleep(0.1)
        return self._step

    def cancel(self, signal: str = "KILL", timeout: float = STEP_END_S) -> bool:
        """Cancel the step (and with it every process of it) and wait for its end; True when it
        ended. scancel may print an error for a step it did kill, so the end is what counts."""
        step = self.step_id()
        if step is not None and self.proc.poll() is None:
            try:
                self._run(cancel_argv(step, signal), capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT_S, check=False)
            except (OSError, subprocess.TimeoutExpired):
                pass
        elif self.proc.poll() is None:
            # Not (yet) known to squeue, e.g. still waiting for its resources: srun passes
            # SIGTERM on to the step's tasks, or gives the step up if it has none yet.
            self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def close(self) -> None:
        """Let go of the step's stdin and log here once it has ended (or been given up on)."""
        for f in (self.proc.stdin, self._log):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def stop(self, timeout: float) -> None:
        """Close the agent's stdin (it stops its workers and exits), then cancel the step if it
        has not ended within `timeout`, then kill srun itself (Slurm ends the step when the job
        does); idempotent."""
        stop_process(self.proc, timeout, escalate=lambda t: self.cancel("KILL", t), log=self._log)


class SlurmTransport:
    """A fault's command on a Slurm node: a one-task step of its own there."""

    def __init__(self, job: str, host: str, name: str) -> None:
        self.host = host
        self.job = job
        self.name = name

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        full = step_argv(self.job, self.host, self.name, argv)
        try:
            proc = subprocess.run(full, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        except FileNotFoundError:
            return CommandResult(tuple(argv), 127, "", "srun: command not found")
        except subprocess.TimeoutExpired:
            return CommandResult(tuple(argv), 124, "", f"timed out after {timeout:g}s")
        return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        # A step's processes end with the step: the command is started as a step of its own that
        # lasts as long as the command (the job's end ends it too).
        subprocess.Popen(step_argv(self.job, self.host, self.name, argv), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


class StepKill:
    """kill-node on a Slurm node: its agent step cancelled with SIGKILL, which Slurm delivers to
    every process of the step (the agent, its ranks and spares)."""

    def __init__(self, step: SlurmStep) -> None:
        self.host = step.host
        self.step = step

    def run(self, argv: Sequence[str], *, timeout: float, input: str | None = None) -> CommandResult:
        ended = self.step.cancel("KILL", min(timeout, STEP_END_S))
        shown = tuple(cancel_argv(self.step.step_id(0.0) or f"{self.step.job}.?", "KILL"))
        return CommandResult(shown, 0 if ended else 1, "", "" if ended else "the step did not end")

    def spawn_detached(self, argv: Sequence[str], *, timeout: float) -> None:
        raise OSError("a step cancel is not detached")


def doctor_transports(env: Mapping[str, str] | None = None) -> list[SlurmTransport]:
    """One transport per node of the allocation (spares included), for `ffctl doctor --backend
    slurm`: each check runs on its node as a step; BadInput outside an allocation."""
    job, names = allocation(os.environ if env is None else env)
    return [SlurmTransport(job, host, "ffctl-doctor") for host in names]
