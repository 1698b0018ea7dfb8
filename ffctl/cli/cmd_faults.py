"""`ffctl faults`: every fault kind, with its keys and what it needs (the catalogue)."""
from __future__ import annotations

import json
import shutil
import textwrap
from typing import Annotated

import typer

from fault_injectors.catalogue import COMMON_KEYS, VALUES, catalogue

SPEC = ("A fault is written KIND:key=value,... (--inject, scenario files, ffctl inject -o). Every kind "
        "takes a target (rank=N, node=N, host=H, or mode=one|all|fixed:N|percent:P with seed=S) and, when "
        "scheduled, a trigger (step=N: once every rank committed step N; t=DURATION: after the job's first "
        "step, a plain script's ranks' start). Durations are written 5, 5s, 500ms or 2m.")


def _key(key: str, required: tuple[str, ...]) -> str:
    text = f"{key}={VALUES.get(key, 'VALUE')}"
    return text + " (required)" if key in required else text


def register(app: typer.Typer) -> None:
    @app.command("faults")
    def faults(
        as_json: Annotated[bool, typer.Option("--json", help="Print the catalogue as JSON.")] = False,
    ) -> int:
        """List every fault kind with its keys and what it needs to run."""
        rows = catalogue()
        if as_json:
            typer.echo(json.dumps({"common_keys": list(COMMON_KEYS), "kinds": [
                {"kind": r.kind.value, "family": r.kind.family.value, "what": r.what, "keys": list(r.keys),
                 "required": list(r.required), "revertible": r.revertible, "needs": r.needs or None}
                for r in rows]}, indent=2))
            return 0
        width = min(shutil.get_terminal_size().columns, 100)
        typer.echo(textwrap.fill(SPEC, width))
        for r in rows:
            typer.echo("")
            typer.echo(textwrap.fill(f"{r.kind.value}: {r.what}", width, subsequent_indent="  "))
            if r.keys:
                typer.echo(textwrap.fill("keys: " + ", ".join(_key(k, r.required) for k in r.keys), width,
                                         initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False))
            if r.needs:
                typer.echo(textwrap.fill("needs: " + r.needs, width, initial_indent="  ", subsequent_indent="    "))
        return 0
