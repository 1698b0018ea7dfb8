"""Testing with ffctl from pytest: `ffctl.testing.jobs` drives real jobs (launch, inject, wait,
report, tear down) and `ffctl.testing.pytest_plugin` hands them to tests as the `ffctl_jobs`
fixture. Importing this package imports nothing else: pytest loads the plugin in every run.
"""
