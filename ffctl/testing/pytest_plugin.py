"""ffctl's pytest plugin (the `pytest11` entry point `ffctl`): the `ffctl_jobs` fixture.

    def test_survives_a_node_loss(ffctl_jobs):
        job = ffctl_jobs.launch("--nnodes", "2", "--nproc-per-node", "1", "--steps", "200", "--spares", "1")
        job.wait_step(10)
        fault = job.wait_recovered(job.inject("kill-node", node=1))
        assert fault["restore_source"] == "peer-memory"
        assert job.wait() == 0 and job.report()["status"] == "completed"

    def test_the_ci_scenario(ffctl_jobs):
        job = ffctl_jobs.scenario("examples/scenarios/gpu-error.toml")
        assert job.wait() == 0, [c.detail for c in job.checks() if not c.passed]

Every job the test started is torn down when it ends, passed, failed or interrupted (see
`ffctl.testing.jobs.Job.close`); what had to be removed by force is reported as a warning.
pytest loads this module in every run of an environment where ffctl is installed, so it imports
nothing but pytest here: the rest comes when a test asks for the fixture.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Iterator

import pytest

if TYPE_CHECKING:
    from ffctl.testing.jobs import Jobs


class FfctlTeardownWarning(UserWarning):
    """A job's processes, rules or files had to be removed by force after its test."""


@pytest.fixture
def ffctl_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jobs]:
    """Start real ffctl jobs (`.launch(*ffctl_launch_args)`, `.scenario(path)`), inject faults
    into them (`job.inject`), wait for a step or a recovery, read their report; all of it is
    torn down after the test, whatever its outcome."""
    from ffctl.testing.jobs import Jobs

    jobs = Jobs(tmp_path_factory.mktemp("ffctl-jobs"), request.node.name)
    try:
        yield jobs
    finally:
        forced = jobs.close()
        if forced:
            warnings.warn(FfctlTeardownWarning(f"{request.node.nodeid}: removed after the test: {'; '.join(forced)}"),
                          stacklevel=1)
