"""How `ffctl ... --help` reads: plain text that wraps at any width and never cuts a word.

Rich's boxed help gave each option's description about 14 columns at 80 and cut option names
and values with "…" (`--nproc-per-node,-…`); click's plain formatter wraps instead, as
torchrun's argparse help does. On top of it: options grouped by their help panel (torchrun's
own options apart), one spelling shown per option (torchrun's `--nproc_per_node` still works,
only `--nproc-per-node` is listed), and argparse-style metavars (`N`, `TEXT`, `PATH`) instead
of typer's `<str>`, none on a flag.
"""
from __future__ import annotations

import enum
import typing
from pathlib import Path

import typer
import typer.core

# typer >= 0.29 carries its own cut-down click (its parameters are typer's classes, types are
# Python's); these are the names both it and click have.
try:
    from typer import _click as click
except ImportError:  # pragma: no cover - older typer uses click itself
    import click  # type: ignore[no-redef]

# The panel options land in when they name none.
OPTIONS = "Options"
# argparse's and click's words for a value, not typer's `<str>`.
_BY_TYPE: dict[object, str] = {int: "N", float: "NUM", Path: "PATH"}


def shown_names(opts: list[str]) -> list[str]:
    """The spellings help lists: a torchrun-style `--snake_case` alias is left out when its
    `--dash-case` twin is there (both are accepted)."""
    dashed = {o for o in opts if o.startswith("--") and "_" not in o}
    return [o for o in opts if not (o.startswith("--") and "_" in o and o.replace("_", "-") in dashed)]


def metavar(param: click.Parameter) -> str:
    """The word after an option in help: its own metavar, else one by its type; none on a flag."""
    if getattr(param, "metavar", None):
        return str(param.metavar)
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    descriptor = getattr(param, "type_descriptor", None)  # typer's: the annotation, Optional taken off
    kind: object = getattr(descriptor, "annotation", str)
    kind = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "|".join(str(m.value) for m in kind)
    return _BY_TYPE.get(kind, "TEXT")


def _names(param: click.Parameter) -> str:
    if param.param_type_name == "argument":
        name = str(param.metavar or (param.name or "").upper())
        return name + ("..." if param.nargs == -1 and not name.endswith("...") else "")
    word = metavar(param)
    shown = ", ".join(shown_names(list(param.opts))) + (f" {word}" if word else "")
    if getattr(param, "secondary_opts", None):
        shown += " / " + ", ".join(param.secondary_opts)
    return shown


class Command(typer.core.TyperCommand):
    """A command whose help is `Arguments`, `Options`, then each named panel, plain text."""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = _names(param)
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {"Arguments": [], OPTIONS: []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            panel = "Arguments" if param.param_type_name == "argument" else (
                getattr(param, "rich_help_panel", None) or OPTIONS)
            panels.setdefault(panel, []).append((_names(param), record[1]))
        for title, rows in panels.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


class Group(typer.core.TyperGroup):
    """The top level: each command with its whole first sentence (click cuts it at 45 columns)."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=1_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def use_plain_help(app: typer.Typer) -> None:
    """Give every command registered on `app` this help (call after registering them)."""
    app.rich_markup_mode = None
    app.info.cls = Group
    for info in app.registered_commands:
        if info.cls in (None, typer.core.TyperCommand):
            info.cls = Command
