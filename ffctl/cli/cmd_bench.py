"""`ffctl bench`: the recovery strategies side by side on the built-in workload under one seeded
fault schedule (`--only NAME`: one of the narrow benchmarks behind the goals in docs/benchmarks.md)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ffctl.exits import EXIT_EXPECTATION, EXIT_OK, BadInput
from ffctl.render import make_console


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(
        model: Annotated[str, typer.Option("--model", help="Built-in GPT size: tiny, small, medium or base.")] = "small",
        steps: Annotated[int, typer.Option("--steps", help="Training steps of each strategy's run.")] = 140,
        mtbf: Annotated[float, typer.Option("--mtbf", help="Mean seconds of training between faults (the schedule's, and Young's MTBF).")] = 12.0,
        seed: Annotated[int, typer.Option("--seed", help="Seed of the fault schedule and of the job.")] = 3,
        kinds: Annotated[str, typer.Option("--kinds", help="Fault kinds drawn: kill-rank, term-rank, crash-rank, kill-node.")] = "kill-rank,kill-node",
        spares: Annotated[int, typer.Option("--spares", help="Warm spare workers per node, for every strategy.")] = 1,
        scale: Annotated[Optional[str], typer.Option("--scale", help="World sizes, e.g. 2,4,8: adds kill-rank recovery against world size.")] = None,
        only: Annotated[Optional[list[str]], typer.Option("--only", help="A narrow benchmark instead: snapshot-overhead, recovery-vs-disk, scale, replacement-start, without-spares, control-plane.")] = None,
        nodes: Annotated[Optional[str], typer.Option("--nodes", help="With --only control-plane: simulated cluster sizes, e.g. 8,64,256,1024.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
        runs_dir: Annotated[Optional[Path], typer.Option("--runs-dir", help="Keep the benchmark runs' records here.")] = None,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the runs it would start and start nothing.")] = False,
    ) -> int:
        """Compare peer, restart-memory and restart-disk (Young's interval) under one fault schedule."""
        from ffctl import bench as lib
        from ffctl.render.bench_results import bench_progress, render_bench, render_strategies

        if only:
            for name in only:
                if name not in lib.BENCHMARKS:
                    raise BadInput(f"--only {name!r}: use one of {', '.join(lib.BENCHMARKS)}")
            if scale is not None:
                raise BadInput(f"--scale {scale!r}: not with --only (the narrow benchmark `scale` has its own sizes)")
            sizes = lib.parse_nodes(nodes) if nodes is not None else None
            if sizes is not None and "control-plane" not in only:
                raise BadInput(f"--nodes {nodes!r}: only with --only control-plane")
            if dry_run:
                typer.echo("\n".join(f"would run {name} (as python benchmarks/{name.replace('-', '_')}.py does)"
                                      + (f" at {','.join(map(str, sizes or lib.CONTROL_PLANE_NODES))} simulated nodes"
                                         if name == "control-plane" else "") for name in only))
                return EXIT_OK
            results = [r.to_dict() for r in lib.run_named(list(only), runs_dir, sizes)]
            typer.echo(json.dumps(results, indent=2)) if as_json else render_bench(results, make_console())
            return EXIT_OK if all(r["met"] for res in results for r in res["ratios"]) else EXIT_EXPECTATION
        if nodes is not None:
            raise BadInput(f"--nodes {nodes!r}: only with --only control-plane")
        spec = lib.BenchSpec(model=model, steps=steps, mtbf_s=mtbf, seed=seed, kinds=lib.parse_kinds(kinds),
                             spares=spares, scale=lib.parse_scale(scale) if scale is not None else ())
        spec.validate()
        if dry_run:
            typer.echo("\n".join(lib.plan(spec)))
            return EXIT_OK
        with bench_progress() as hear:
            result = lib.compare_strategies(spec, runs_dir, progress=hear)
        typer.echo(json.dumps(result, indent=2)) if as_json else render_strategies(result, make_console())
        return EXIT_OK
