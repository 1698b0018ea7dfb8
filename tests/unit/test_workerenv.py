"""Which allocator settings a rank's process starts with."""
from __future__ import annotations

import pytest

from ffctl.agent.workerenv import KEEP_FREED_MEMORY, allocator_configured, worker_env


def test_defaults_added_over_host_and_job_env() -> None:
    env = worker_env({"PATH": "/bin", "A": "host"}, {"A": "job"}, keep_freed_memory=True)
    assert env == {"PATH": "/bin", "A": "job", **KEEP_FREED_MEMORY}


def test_release_leaves_env_alone() -> None:
    assert worker_env({"PATH": "/bin"}, {}, keep_freed_memory=False) == {"PATH": "/bin"}


@pytest.mark.parametrize("env", [
    {"MALLOC_ARENA_MAX": "4"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    {"LD_PRELOAD": "libtcmalloc_minimal.so.4"},
])
def test_an_allocator_the_host_chose_is_kept(env: dict[str, str]) -> None:
    assert allocator_configured(env)
    assert worker_env(env, {}, keep_freed_memory=True) == env


def test_the_job_env_can_choose_too() -> None:
    assert worker_env({}, {"MALLOC_TRIM_THRESHOLD_": "0"}, keep_freed_memory=True) == {"MALLOC_TRIM_THRESHOLD_": "0"}


def test_unrelated_tunables_and_preloads_do_not_count() -> None:
    assert not allocator_configured({"GLIBC_TUNABLES": "glibc.rtld.nns=8", "LD_PRELOAD": "libfoo.so"})
