"""The `ffctl` typer application and its error handling: bad input is one line and exit code 2."""
from __future__ import annotations

import sys

import click
import typer

from ffctl import __version__
from ffctl.cli import agent_cmd, inject, launch, report
from ffctl.errors import EXIT_BAD_INPUT, EXIT_INFRA, BadInput, InfraError

app = typer.Typer(
    name="ffctl", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Chaos testing and one-step recovery for distributed PyTorch training.",
)
launch.register(app)
inject.register(app)
report.register(app)
agent_cmd.register(app)
for optional in ("doctor", "scenario", "bench"):
    try:
        module = __import__(f"ffctl.cli.{optional}", fromlist=["register"])
        module.register(app)
    except ImportError:
        pass


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    if version:
        typer.echo(__version__)
        raise typer.Exit(0)


def main(argv: list[str] | None = None) -> None:
    try:
        result = app(args=argv, standalone_mode=False)
    except click.exceptions.UsageError as exc:
        typer.echo(f"ffctl: error: {exc.format_message()}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except BadInput as exc:
        typer.echo(f"ffctl: error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except InfraError as exc:
        typer.echo(f"ffctl: error: {exc}", err=True)
        sys.exit(EXIT_INFRA)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(result if isinstance(result, int) else 0)
