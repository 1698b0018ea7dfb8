"""The `ffctl` typer application and its error handling: bad input is one line and exit code 2."""
from __future__ import annotations

import sys

import typer

try:  # typer >= 0.16 ships its own copy of click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exc  # type: ignore[no-redef]

from ffctl import __version__
from ffctl.cli import (cmd_agent, cmd_bench, cmd_doctor, cmd_faults, cmd_inject, cmd_launch, cmd_project,
                       cmd_report, cmd_scenario)
from ffctl.cli.help import use_plain_help
from ffctl.exits import EXIT_BAD_INPUT, EXIT_INFRA, EXIT_NO_REQUEUE, BadInput, InfraError, NoRequeue

app = typer.Typer(
    name="ffctl", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Chaos testing and one-step recovery for distributed PyTorch training.",
)
cmd_launch.register(app)
cmd_inject.register(app)
cmd_faults.register(app)
cmd_report.register(app)
cmd_project.register(app)
cmd_agent.register(app)
# Every command is registered unconditionally: a command that failed to import (a missing
# dependency) must fail loudly, not vanish from `ffctl --help`.
cmd_doctor.register(app)
cmd_scenario.register(app)
cmd_bench.register(app)
use_plain_help(app)


@app.callback(invoke_without_command=True)
def _root(version: bool = typer.Option(False, "--version", help="Print the version and exit.")) -> None:
    if version:
        typer.echo(__version__)
        raise typer.Exit(0)


def _given(exc: Exception, argv: list[str] | None) -> str:
    """Name the value a user gave for a badly typed option (click's message does not)."""
    param = getattr(exc, "param", None)
    args = sys.argv[1:] if argv is None else argv
    for opt in getattr(param, "opts", []) or []:
        for i, word in enumerate(args):
            if word == opt and i + 1 < len(args):
                return f" (got {args[i + 1]!r})"
            if word.startswith(opt + "="):
                return f" (got {word.split('=', 1)[1]!r})"
    return ""


def main(argv: list[str] | None = None) -> None:
    try:
        result = app(args=argv, standalone_mode=False)
    except click_exc.UsageError as exc:
        typer.echo(f"ffctl: error: {exc.format_message()}{_given(exc, argv)}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except BadInput as exc:
        typer.echo(f"ffctl: error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except InfraError as exc:
        typer.echo(f"ffctl: error: {exc}", err=True)
        sys.exit(EXIT_INFRA)
    except NoRequeue as exc:
        typer.echo(f"ffctl: {exc}", err=True)
        sys.exit(EXIT_NO_REQUEUE)
    except typer.Abort:
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(getattr(exc, "exit_code", 0))
    sys.exit(result if isinstance(result, int) else 0)
