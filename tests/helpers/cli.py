"""`ffctl` through its real entry point in the test's own process, output captured as a pipe
would have it: for tests of what a command prints and exits with, without a subprocess each."""
from __future__ import annotations

from typer.testing import CliRunner

from ffctl.cli.app import main


def ffctl_in_process(argv: list[str], env: dict[str, str | None] | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `ffctl ARGV`; `env` on top of COLUMNS unset (a pipe: 80
    columns) and TERM=dumb."""
    with CliRunner().isolation(env={"COLUMNS": None, "TERM": "dumb", **(env or {})}) as (out, err, _):
        try:
            main(argv)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        return code, out.getvalue().decode(), err.getvalue().decode()
