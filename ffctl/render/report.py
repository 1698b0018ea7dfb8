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
    faults = Table(title=title, title_justify="left", show_lines=False)
    for col in ("fault", "kind", "target", "at step", "detect s", "recovery s", "detect", "decide", "spawn",
                "rendezvous", "restore", "replay", "lost steps", "source", "lost GPU-h", "emulated"):
        faults.add_column(col, justify="right" if col not in ("kind", "target", "source", "fault") else "left")
    for f in report["faults"]:
        b = f["breakdown"]
        faults.add_row(
            f["fault_id"], f["kind"], f["target"], str(f["at_step"]), _s(f["detection_s"]),
            _s(f["recovery_s"]) if f["recovered"] else "[red]not recovered[/red]",
            *(_s(b.get(k)) for k in ("detect", "decide", "spawn", "rendezvous", "restore", "replay")),
            str(f["lost_steps"]), f["restore_source"] or "-", f"{f['lost_gpu_hours']:.6f}",
            "yes" if f["emulated"] else "no",
        )
    if not report["faults"]:
        faults.add_row("-", "no faults", *[""] * 14)
    console.print(faults)
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
        console.print(line, markup=False, highlight=False)
