"""Faults raised inside a rank's step: crash-rank and the GPU faults.

An injector writes the fault's name to the rank's fault file (`runs.shm.fault_path`) and sends SIGUSR1.
The handler only sets a flag (nothing unsafe in a signal handler); the next `check()`, at the
start of a step, raises the fault there as the real failure would. On a CUDA host the GPU faults
act on the device; elsewhere they are emulated and say so.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from runs.shm import UnsafeShm, fault_path, read_small


class InjectedDeviceError(RuntimeError):
    """An emulated device error (what a CUDA error would raise inside the step)."""


class InStepFaults:
    def __init__(self, fault_dir: str, run_id: str, rank: int) -> None:
        # No directory (a rank not started by an agent): no in-step fault can reach it.
        self.path = Path(fault_path(fault_dir, run_id, rank)) if fault_dir else None
        self.pending = False
        self._hog: list[Any] = []

    def install(self) -> None:
        signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.pending = True

    def check(self) -> None:
        if not self.pending or self.path is None:
            return
        self.pending = False
        try:
            # Bounded and never through a symlink: the file sits in the run's private directory,
            # and even so only a small regular file of ours is read.
            what = read_small(self.path).decode("utf-8", errors="replace").strip()
            self.path.unlink()
        except FileNotFoundError:
            return
        except UnsafeShm:
            self.path.unlink(missing_ok=True)
            return
        self.fire(what)

    def fire(self, what: str) -> None:
        kind, _, arg = what.partition(":")
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
