"""`ffctl bench` rendering: one row per ratio, with its goal."""
from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def render_bench(results: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="ffctl bench (ratios measured side by side in this run)", title_justify="left")
    for col in ("benchmark", "ratio", "numerator", "denominator", "value", "goal", "met"):
        table.add_column(col, justify="left" if col in ("benchmark", "ratio") else "right")
    for res in results:
        for r in res["ratios"]:
            table.add_row(res["name"], r["name"], f"{r['numerator']:.4g}", f"{r['denominator']:.4g}",
                          f"{r['value']:.3f}", f"<= {r['goal']}", "yes" if r["met"] else "[red]no[/red]")
    console.print(table)
