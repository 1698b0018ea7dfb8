"""`ffctl bench`: recovery strategies side by side on the built-in workload, as ratios."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ffctl.errors import EXIT_EXPECTATION, EXIT_OK, BadInput
from ffctl.render import make_console


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        only: Annotated[Optional[list[str]], typer.Option("--only", help="snapshot-overhead, recovery-vs-disk, scale, replacement-start, without-spares")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
        runs_dir: Annotated[Optional[Path], typer.Option("--runs-dir", help="Keep the benchmark runs' records here.")] = None,
    ) -> int:
        """Measure snapshot overhead, peer vs restart-disk recovery, and recovery at scale."""
        from ffctl import bench as lib
        from ffctl.render.bench import render_bench

        for name in only or []:
            if name not in lib.BENCHMARKS:
                raise BadInput(f"--only {name!r}: use one of {', '.join(lib.BENCHMARKS)}")
        results = [r.to_dict() for r in lib.run(list(only) if only else None, runs_dir)]
        if as_json:
            typer.echo(json.dumps(results, indent=2))
        else:
            render_bench(results, make_console())
        return EXIT_OK if all(r["met"] for res in results for r in res["ratios"]) else EXIT_EXPECTATION
