"""The library a training script links to survive its peers' failures.

Register the training state as callables, call `Job.run(step_fn, steps)`, and use `job.allreduce`
for the collectives that may be interrupted; or, with torch's DistributedDataParallel, build it
over `job.ddp_group()` and hand model, optimizer, scheduler and data loader to
`job.register_ddp` (`recovery.ddp`, docs/guides/ddp.md). The library keeps a per-step snapshot in the node
agent's shared memory, aborts a failed collective, rebuilds the process group for the next
generation and restores (at most one step back) in one step. It never imports ffctl.
"""
from __future__ import annotations

import warnings

# torch warns at import when numpy is missing; this library never converts tensors to numpy and
# numpy is not a dependency, so the warning is silenced before the imports below load torch.
warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy: No module named 'numpy'",
                        category=UserWarning)

from typing import TYPE_CHECKING, Any

from recovery.errors import PeerFailure, RecoveryError

if TYPE_CHECKING:
    from recovery.job import Job, StepContext
    from recovery.steps import report_step

__all__ = ["Job", "PeerFailure", "RecoveryError", "StepContext", "report_step"]


def __getattr__(name: str) -> Any:
    # These load torch (a second and a half of CPU). The launcher imports this package for its
    # plain parts (`PeerFailure`) in processes that never touch torch (`ffctl report`,
    # `ffctl --help`, a bad command line), and must not pay for it; a script's
    # `from recovery import Job` loads it here, on first use.
    if name in ("Job", "StepContext"):
        from recovery import job

        return getattr(job, name)
    if name == "report_step":
        from recovery import steps

        return steps.report_step
    raise AttributeError(f"module 'recovery' has no attribute {name!r}")
