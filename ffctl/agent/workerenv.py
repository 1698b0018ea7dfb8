"""The memory-allocator settings a rank's process starts with, unless the host chose its own.

glibc hands large blocks back to the kernel when they are freed (`munmap`, or trimming the top
of the heap) and faults them in again, page by page, the next time they are allocated. A training
step allocates and frees the same large activation and gradient buffers every step, so on a CPU
host each step can pay tens of thousands of page faults in system time. How many depends on the
order of frees, which the snapshot's capture changes: measured on the built-in GPT, an unchanged
glibc faulted 9k pages per step without snapshots and 20k with them. Keeping freed memory in
the process (a fixed mmap threshold at glibc's 32 MiB maximum and a 1 GiB trim threshold) takes
both to almost none. This is what CPU-training launchers do with jemalloc or tcmalloc; ffctl only
sets glibc's own knobs, and never where the host already configured an allocator.
"""
from __future__ import annotations

from collections.abc import Mapping

KEEP_FREED_MEMORY = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # glibc's ceiling for the mmap threshold
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}
_PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def allocator_configured(env: Mapping[str, str]) -> bool:
    """Whether the environment already chooses how the allocator behaves."""
    if any(key.startswith("MALLOC_") for key in env):
        return True
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return True
    preload = env.get("LD_PRELOAD", "")
    return any(name in preload for name in _PRELOADED_ALLOCATORS)


def worker_env(host_env: Mapping[str, str], job_env: Mapping[str, str], keep_freed_memory: bool) -> dict[str, str]:
    """A worker's environment: the host's, then the job's, with the allocator settings above
    where neither the host nor the job set any, and torchrun's `OMP_NUM_THREADS=1` where the
    node runs more than one rank and neither set it."""
    env = {**host_env, **job_env}
    # torchrun's rule: several processes per node each start one OpenMP thread unless told
    # otherwise, or they oversubscribe the node's cores.
    if "OMP_NUM_THREADS" not in env and int(env.get("LOCAL_WORLD_SIZE", "1") or 1) > 1:
        env["OMP_NUM_THREADS"] = "1"
    if keep_freed_memory and not allocator_configured(env):
        env.update(KEEP_FREED_MEMORY)
    return env
