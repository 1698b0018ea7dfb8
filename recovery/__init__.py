"""The library a training script links to survive its peers' failures.

Register the training state as callables, call `Job.run(step_fn, steps)`, and use `job.allreduce`
for the collectives that may be interrupted; or, with torch's DistributedDataParallel, build it
over `job.ddp_group()` and hand model, optimizer, scheduler and data loader to
`job.register_ddp` (`recovery.ddp`, docs/ddp.md). The library keeps a per-step snapshot in the node
agent's shared memory, aborts a failed collective, rebuilds the process group for the next
generation and restores (at most one step back) in one step. It never imports ffctl.
"""
from __future__ import annotations

import warnings

# torch warns at import when numpy is missing; this library never converts tensors to numpy and
# numpy is not a dependency, so the warning is silenced before the imports below load torch.
warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy: No module named 'numpy'",
                        category=UserWarning)

from recovery.errors import PeerFailure, RecoveryError
from recovery.job import Job, StepContext
from recovery.steps import report_step

__all__ = ["Job", "PeerFailure", "RecoveryError", "StepContext", "report_step"]
