"""`ffctl report` rendering: a table per run's faults plus the run's totals."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_report(report: dict[str, Any], console: Console) -> None:
    title = (f"run {report['run_id']}  status {report['status']}  strategy {report['strategy']}  "
             f"world {report['world_size']}  steps {report['steps_completed']}  "
             f"final loss {_s(report['final_loss'], 4)}")
    faults = Table(title=title, title_justify="left")
    for col in ("fault", "kind", "target", "step", "detect s", "recover s", "lost", "source", "GPU-h", "emu"):
        faults.add_column(col, justify="left" if col in ("fault", "kind", "target", "source") else "right",
                          no_wrap=col in ("kind", "source"))
    phases = Table(title="recovery breakdown (s)", title_justify="left")
    for col in ("fault", "detect", "decide", "spawn", "rendezvous", "restore", "replay"):
        phases.add_column(col, justify="left" if col == "fault" else "right")
    for f in report["faults"]:
        faults.add_row(
            f["fault_id"], f["kind"], f["target"], str(f["at_step"]), _s(f["detection_s"]),
            _s(f["recovery_s"]) if f["recovered"] else "[red]not recovered[/red]",
            str(f["lost_steps"]), f["restore_source"] or "-", f"{f['lost_gpu_hours']:.6f}",
            "yes" if f["emulated"] else "no",
        )
        b = f["breakdown"]
        phases.add_row(f["fault_id"], *(_s(b.get(k)) for k in ("detect", "decide", "spawn", "rendezvous", "restore", "replay")))
    if not report["faults"]:
        faults.add_row("-", "no faults", *[""] * 8)
    console.print(faults)
    if report["faults"]:
        console.print(phases)
    totals = Table(show_header=False, box=None)
    totals.add_column(style="bold")
    totals.add_column()
    totals.add_row("lost GPU-hours", f"{report['lost_gpu_hours_total']:.6f}")
    totals.add_row("spare GPU-hours", f"{report['spare_gpu_hours']:.6f}")
    totals.add_row("goodput", _s(report["goodput"], 3))
    totals.add_row("wall time s", _s(report.get("wall_s")))
    console.print(totals)


def render_plan(lines: list[str], console: Console) -> None:
    for line in lines:
        # Never wrapped: these are commands a user copies, word for word.
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def render_checks(checks: list[tuple[str, bool, str]], console: Console) -> None:
    table = Table(title="expectations", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail")
    for name, passed, detail in checks:
        table.add_row(name, "[green]ok[/green]" if passed else "[red]missed[/red]", detail)
    console.print(table)
