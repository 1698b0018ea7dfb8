"""A worker's end: a DDP model freed at the end of a script never deadlocks its process.

torch's DDP keeps its process group twice: as a Python object (`ddp.process_group`, whose
binding lets go of the GIL while the group's destructor runs) and inside its C++ `Reducer`
(whose binding does not). When a script's DDP model is freed (its `main()` returns, or the
interpreter exits) the module's attributes go in the order they were set: `process_group` first,
`reducer` last, so the Reducer drops the last reference and `ProcessGroupGloo`'s destructor joins
gloo's worker threads *with the GIL held*. A worker thread that just finished the last
allreduce is at that moment freeing the work, whose captured thread-local state holds a Python
object (torch stashes a `contextvars` context there during every backward); it waits for the
GIL, the destructor waits for it: the rank prints its last line and never exits.

The window is one GIL switch interval after the last allreduce, so it is hit when the script's
last lines run fast: measured on the DDP tutorial's pattern (2 ranks, gloo, a few epochs), 3-4
runs in 10 hang once torch's lazy modules are imported before the script starts (as in a warm
worker), 0 in 30 in a fresh interpreter, 0 in 20 with this guard (docs/decisions/
0009-scripts-end-as-under-python.md).

The guard gives DDP a finalizer that frees the Reducer while the group is still held by the
Python object, then drops that object: the group is destroyed through its own binding, which
releases the GIL, and the worker thread finishes. Nothing of the training changes: the order in
which a dead model's members are freed is all it touches.
"""
from __future__ import annotations

from typing import Any


def _free_reducer_first(self: Any) -> None:
    """DDP's `__del__`: the Reducer before the process group (see the module's docstring)."""
    members = self.__dict__
    group = members.get("process_group")
    members.pop("reducer", None)
    del group  # the group's last reference, if it was, now goes through its own binding


def guard_ddp_teardown() -> bool:
    """Give torch's DistributedDataParallel the finalizer above (once). False where this torch
    has no DDP or DDP has a finalizer of its own, which is then left as it is."""
    try:
        from torch.nn.parallel import DistributedDataParallel as DDP
    except ImportError:
        return False
    if getattr(DDP, "__del__", None) is _free_reducer_first:
        return True
    if hasattr(DDP, "__del__"):
        return False
    DDP.__del__ = _free_reducer_first  # type: ignore[attr-defined]
    return True
