"""`ffctl bench` rendering: the strategies side by side (each figure with its ratio to the
baseline), the narrow benchmarks' ratios with their goals, and the progress bar of a bench run.

The comparison fits 80 columns, what a pipe gets; the progress bar is drawn on stderr and only
when stderr is a terminal, so output piped to a file holds the results alone.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ffctl.render.tables import table_or_records

# Figure key, label, format of a value.
FIGURE_ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("recovery_s", "recovery s", lambda v: f"{v:.2f}"),
    ("lost_s", "lost s", lambda v: f"{v:.2f}"),
    ("lost_steps", "lost steps", lambda v: f"{int(v)}"),
    ("lost_gpu_hours", "lost GPU-h", lambda v: f"{v:.5f}"),
    ("goodput", "goodput", lambda v: f"{v:.3f}"),
    ("snapshot_overhead", "snapshot overhead", lambda v: f"{v:.3f}"),
]


def _cell(row: dict[str, Any], key: str, fmt: Callable[[Any], str], baseline: bool) -> str:
    value = row.get(key)
    if value is None:
        return "-"
    r = (row.get("ratios") or {}).get(key)
    return fmt(value) if baseline else f"{fmt(value)} ({'-' if r is None else f'{r:.2f}x'})"


def faults_text(result: dict[str, Any]) -> str:
    """The schedule in words: `kill-rank rank=1 @ 22, kill-node node=1 @ 43`."""
    return ", ".join(f"{f['kind']} {f['target']} @ {f['step']}" for f in result["schedule"]) or "none"


def young_lines(result: dict[str, Any]) -> list[str]:
    """Which interval restart-disk used and how it was reached, in lines that fit 80 columns."""
    y, cal = result["young"], result["calibration"]
    return [f"{result['baseline']}: a checkpoint every {y['interval_steps']} steps, Young's interval at "
            f"{cal['pace_s']:.3f} s a step:",
            f"  {y['formula']} = sqrt(2 x {y['mtbf_s']:g} s x {y['save_s']:.3f} s) = {y['interval_s']:.2f} s"]


def render_strategies(result: dict[str, Any], console: Console) -> None:
    """The comparison: its setting, then a figure per row and a strategy per column."""
    base = result["baseline"]
    rows = result["strategies"]
    console.print(f"[bold]ffctl bench[/bold]: --model {result['model']}, {result['nnodes']} nodes x "
                  f"{result['nproc_per_node']} ranks, {result['steps']} steps, --spares {result['spares']}, "
                  f"{result['cores']} cores", soft_wrap=False)
    console.print(f"faults (seed {result['seed']}, MTBF {result['mtbf_s']:g} s, the same steps for every strategy):")
    console.print(f"  {faults_text(result)}")
    for line in young_lines(result):
        console.print(line)
    figures = [["recovered", *(f"{r['recovered']}/{r['faults']}" for r in rows)]]
    for key, label, fmt in FIGURE_ROWS:
        figures.append([label, *(_cell(r, key, fmt, r["strategy"] == base) for r in rows)])
    figures.append(["checkpoint every", *(str(r["ckpt_every"]) if r["ckpt_every"] else "-" for r in rows)])
    table_or_records(console, f"sums over the faults (ratio to {base})", ["figure", *(r["strategy"] for r in rows)],
                     figures)
    console.print("goodput: higher is better; every other figure: lower is better.")
    console.print("snapshot overhead: time per step before the first fault / that of a fault-free")
    console.print("run without snapshots just before it.")
    if result.get("scale"):
        strategies = [r["strategy"] for r in rows]
        lines = []
        for world in sorted({r["world_size"] for r in result["scale"]}):
            at = {r["strategy"]: r for r in result["scale"] if r["world_size"] == world}
            cells = []
            for s in strategies:
                r = at.get(s, {})
                v, q = r.get("recovery_s"), r.get("recovery_ratio")
                cells.append("-" if v is None else f"{v:.2f}" if s == base else
                             f"{v:.2f} ({'-' if q is None else f'{q:.2f}x'})")
            lines.append([str(world), str(next(iter(at.values()))["batch_per_rank"]), *cells])
        table_or_records(console, f"kill-rank recovery s by world size (ratio to {base})",
                         ["ranks", "batch/rank", *strategies], lines, left=0)
    console.print(f"bench wall time {result['bench_wall_s']:.0f} s")


def render_bench(results: list[dict[str, Any]], console: Console) -> None:
    """The narrow benchmarks (`--only NAME`): a table per benchmark, one row per ratio with its
    goal. Ratio names fold onto further lines and figures never wrap, so at 80 columns (a pipe)
    no value is cut."""
    console.print("ffctl bench (ratios measured side by side in this run)")
    for res in results:
        table = Table(title=res["name"], title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                      pad_edge=False, padding=(0, 1), collapse_padding=True)
        table.add_column("ratio", overflow="fold")
        for col in ("measured", "value", "goal", "met"):
            table.add_column(col, justify="right", no_wrap=True)
        for r in res["ratios"]:
            table.add_row(r["name"], f"{r['numerator']:.4g} / {r['denominator']:.4g}", f"{r['value']:.3f}",
                          f"<= {r['goal']}", "yes" if r["met"] else "[red]no[/red]")
        console.print()
        console.print(table)
        if res["name"] == "control-plane":
            render_control_plane(res["details"]["sizes"], console)


# Column, row key, format: the control plane's phases per cluster size (seconds).
CONTROL_PLANE_COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("detect", "detection_s", lambda v: f"{v:.2f}"),
    ("decide", "decision_s", lambda v: f"{v:.2f}"),
    ("plan", "plan_published_s", lambda v: f"{v:.2f}"),
    ("joined", "joined_s", lambda v: f"{v:.2f}"),
    ("total", "recovery_s", lambda v: f"{v:.2f}"),
    ("ctl cpu", "controller_cpu_share", lambda v: f"{100 * v:.0f}%"),
    ("sim cpu", "sim_cpu_share", lambda v: f"{100 * v:.0f}%"),
    ("keys", "store_keys", lambda v: f"{v}"),
]


def render_control_plane(rows: list[dict[str, Any]], console: Console) -> None:
    """The recovery's control-plane phases per simulated cluster size, one row per size."""
    console.print()
    table_or_records(console, "a simulated node lost: phases (s), CPU (of a core) before it",
                     ["nodes", *(col for col, _, _ in CONTROL_PLANE_COLUMNS)],
                     [[str(row["nodes"]), *("-" if row.get(key) is None else fmt(row[key])
                                            for _, key, fmt in CONTROL_PLANE_COLUMNS)] for row in rows], left=0)
    console.print("detect: silence to node_lost; decide: to recovery_decided; plan: to the")
    console.print("last rank's read of the new plan; joined: to every rank joined and restored;")
    console.print("total: the four together.")


@contextmanager
def bench_progress(console: Console | None = None) -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress bar over every step the bench plans, on stderr; None where stderr is not a
    terminal (nothing is drawn, so a log or a pipe stays clean)."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def hear(label: str, done: int, total: int) -> None:
            bar.update(task, description=label, completed=done, total=total)

        yield hear
