"""Faults raised inside a rank's step: crash-rank, the GPU faults and the stragglers.

An injector drops the fault's name in the rank's mailbox (`runs.shm.mailbox`, a file per fault) and
sends SIGUSR1. The handler only sets a flag (nothing unsafe in a signal handler); `check()`, at
the start of the next step, takes every fault in the mailbox, oldest first, and raises the fault
there as the real failure would. Two signals close together arrive as one and one can be missed,
so a step also looks when no signal came for LOOK_EVERY_S. On a CUDA host the GPU faults
act on the device; elsewhere they are emulated and say so.

A straggler (`slow:<factor>:<seconds>`, from slow-rank and slow-node) makes every step slower
instead: `check()` sleeps (factor - 1) times the rank's step time as it was before the slowdown,
until the seconds are over or `slow:off` arrives (`fault_injectors.straggler` says why a sleep).

A kill at a phase (`kill-at:<phase>:<step>`, from kill-rank with phase=) arms the rank instead:
the job calls `at(phase, step)` where each phase of its step happens, and the first call for the
armed phase in the armed step or later says where it landed (`on_land`) and SIGKILLs the rank
there, as a kill from outside would, but in that very phase.
"""
from __future__ import annotations

import os
import signal
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from runs.events import StepPhase
from runs.shm import UnsafeShm, fault_path, mailbox, read_small


class InjectedDeviceError(RuntimeError):
    """An emulated device error (what a CUDA error would raise inside the step)."""


# How many recent steps the slowdown's base step time is the median of: one slow step (a
# warm-up, a recovery) does not make the base.
BASE_STEPS = 5
# How often a step looks at the mailbox when no signal came. Well inside the lead a kill at a
# phase is armed with (`wire.fault_spec.PHASE_LEAD_S`).
LOOK_EVERY_S = 0.5


class InStepFaults:
    def __init__(self, fault_dir: str, run_id: str, rank: int) -> None:
        # No directory (a rank not started by an agent): no in-step fault can reach it.
        self.path = Path(fault_path(fault_dir, run_id, rank)) if fault_dir else None
        self.pending = False
        self._looked = -LOOK_EVERY_S  # when the mailbox was last looked at (the first step looks)
        self._hog: list[Any] = []
        # The straggler: recent step times (this rank's own sleeps taken out), and while slowed,
        # the factor, the base step time it multiplies (frozen at the onset: measured during the
        # slowdown it would include peers' waits for this rank and grow) and when it ends.
        self._steps: deque[float] = deque(maxlen=BASE_STEPS)
        self._last_check: float | None = None
        self._slept = 0.0
        self.slow_factor: float | None = None
        self._slow_base: float | None = None
        self._slow_until = 0.0
        # A kill armed for (phase, first step), and who hears where it landed before it fires.
        self.armed: tuple[StepPhase, int] | None = None
        self.on_land: Callable[[StepPhase, int], None] | None = None

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.pending = True

    def check(self) -> None:
        """At the start of a step: fire a fault that arrived, then slow the step if a straggler
        fault is in force."""
        now = time.monotonic()
        if self._last_check is not None:
            self._steps.append(max(0.0, now - self._last_check - self._slept))
        self._last_check, self._slept = now, 0.0
        # After a signal, and at least every LOOK_EVERY_S without one: a signal can be missed
        # (sent before the handler is in place, or two merged), and a kill armed for a later step
        # once never landed. Not every step: a look is a directory scan (18 us), the clock 0.1 us.
        if self.path is not None and (self.pending or now - self._looked >= LOOK_EVERY_S):
            self._looked = now
            self._take()
        if self.slow_factor is not None:
            self._slow(now)

    def _slow(self, now: float) -> None:
        if now >= self._slow_until:
            self.slow_factor = self._slow_base = None
            return
        if self._slow_base is None:
            if not self._steps:
                return  # no step measured yet: this one is, unslowed, and sets the base
            self._slow_base = statistics.median(self._steps)
        assert self.slow_factor is not None
        pause = min((self.slow_factor - 1.0) * self._slow_base, self._slow_until - now)
        time.sleep(pause)
        self._slept = pause

    def _take(self) -> None:
        assert self.path is not None
        self.pending = False
        for path in mailbox(self.path):
            try:
                # Bounded and never through a symlink: the file sits in the run's private
                # directory, and even so only a small regular file of ours is read.
                what = read_small(path).decode("utf-8", errors="replace").strip()
                path.unlink()
            except FileNotFoundError:
                continue
            except UnsafeShm:
                path.unlink(missing_ok=True)
                continue
            try:
                self.fire(what)
            except BaseException:
                self.pending = True  # a fault raised here: the ones after it, at the next step
                raise

    def at(self, phase: StepPhase, step: int) -> None:
        """The rank is in `phase` of `step`: a kill armed for it fires here."""
        armed = self.armed
        if armed is None or armed[0] is not phase or step < armed[1]:
            return
        self.armed = None
        if self.on_land is not None:
            try:
                self.on_land(phase, step)
            except Exception:  # the controller may be unreachable: the kill still lands
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    def fire(self, what: str) -> None:
        kind, _, arg = what.partition(":")
        if kind == "slow":
            self._set_slow(arg)
            return
        if kind == "kill-at":
            phase, _, step = arg.partition(":")
            if phase not in StepPhase._value2member_map_ or not (step.isascii() and step.isdigit()):
                raise RuntimeError(f"unknown in-step fault {what!r}")
            self.armed = (StepPhase(phase), int(step))
            return
        cuda = torch.cuda.is_available()
        if kind == "crash-rank":
            if arg == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            raise RuntimeError("crash-rank: exception raised inside the training step")
        if kind == "gpu-error":
            if cuda:
                # An out-of-bounds index trips a device-side assert: a real CUDA error, raised
                # at the next synchronisation, that poisons the context as a kernel fault would.
                x = torch.zeros(1, device="cuda")
                x[torch.tensor([1 << 20], device="cuda")] = 1.0
                torch.cuda.synchronize()
            raise InjectedDeviceError("CUDA error: an illegal memory access was encountered (emulated gpu-error)")
        if kind == "gpu-xid":
            raise InjectedDeviceError(f"CUDA error: unspecified launch failure ({'Xid 79' if not arg else arg}, "
                                      f"{'device' if cuda else 'emulated'} gpu-xid)")
        if kind == "gpu-oom":
            mb = int(arg or 0) or 1 << 20  # no size given: a TiB, more than any device has
            if cuda:
                self._hog.append(torch.empty(mb << 20, dtype=torch.uint8, device="cuda"))
            raise torch.OutOfMemoryError(f"CUDA out of memory: tried to allocate {mb} MiB (emulated gpu-oom)")
        if kind == "gpu-hang":
            # Device work that never completes: the step blocks until the hang detector acts.
            if cuda:
                torch.cuda._sleep(1 << 62)
                torch.cuda.synchronize()
            while True:
                time.sleep(3600)
        raise RuntimeError(f"unknown in-step fault {what!r}")

    def _set_slow(self, arg: str) -> None:
        """`off`, or `<factor>:<seconds>` (written by `fault_injectors.straggler`)."""
        if arg == "off":
            self.slow_factor = self._slow_base = None
            return
        factor, _, seconds = arg.partition(":")
        try:
            self.slow_factor = max(1.0, float(factor))
            self._slow_until = time.monotonic() + max(0.0, float(seconds))
        except ValueError:
            raise RuntimeError(f"unknown in-step fault 'slow:{arg}'") from None
        self._slow_base = None
