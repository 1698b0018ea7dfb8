"""`ffctl doctor` rendering: one table row per host, then each host's problems, one a line."""
from __future__ import annotations

from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ffctl.render.tables import fits, table_or_records

from ffctl.hosts.doctor import HostReport, QdiscSupport

_YES = "[green]✓[/green]"
_NO = "[red]✗[/red]"
_DASH = "[dim]-[/dim]"


def _flag(value: bool | None) -> str:
    return _DASH if value is None else (_YES if value else _NO)


def _version(value: str | None) -> str:
    return f"[green]{escape(value)}[/green]" if value else _NO


def _bytes(value: int | None) -> str:
    if value is None:
        return _DASH
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return _DASH  # unreachable; keeps type checkers content


def _qdisc(value: QdiscSupport) -> str:
    return {
        QdiscSupport.USABLE: _YES,
        QdiscSupport.PRESENT: "[yellow]module[/yellow]",
        QdiscSupport.ABSENT: _NO,
        QdiscSupport.UNKNOWN: "[yellow]?[/yellow]",
    }[value]


def _gpu(report: HostReport) -> str:
    if not report.nvidia_smi:
        return _DASH
    count = "?" if report.gpu_count is None else str(report.gpu_count)
    return f"{count}" + (" +dcgm" if report.dcgmi else "")


def _clock(report: HostReport) -> str:
    if report.clock_offset_s is None:
        return _DASH
    text = f"{report.clock_offset_s * 1000:+.1f} ms"
    if report.clock_rtt_s is not None:
        text += f" [dim](rtt {report.clock_rtt_s * 1000:.1f})[/dim]"
    return text if abs(report.clock_offset_s) <= 0.5 else f"[yellow]{text}[/yellow]"


def render_doctor(reports: Sequence[HostReport], console: Console) -> None:
    """Draw the hosts table, then one line per problem found (nothing when all is well)."""
    columns = [
        "host", "ssh", "python", "torch", "ffctl", "mem avail", "/dev/shm free", "root",
        "iptables", "tc", "tbf", "netem", "GPUs", "clock offset", "can run job",
    ]
    rows = []
    for r in reports:
        if not r.ssh_ok:
            rows.append([escape(r.host), _NO, *[_DASH] * (len(columns) - 3), _NO])
            continue
        rows.append([
            escape(r.host), _YES, _version(r.python), _version(r.torch), _version(r.ffctl),
            _bytes(r.mem_available_bytes), _bytes(r.shm_free_bytes), _flag(r.is_root),
            _flag(r.iptables), _flag(r.tc), _qdisc(r.tbf), _qdisc(r.netem), _gpu(r), _clock(r),
            _flag(r.can_run_job),
        ])
    # Boxed where it fits the width (a cell per check, as it always was), else a host per line
    # as `field: value` pairs: never a cell cut to one letter.
    table = Table(title="ffctl doctor", title_justify="left")
    for name in columns:
        table.add_column(name, justify="left" if name in ("host", "clock offset") else "center", no_wrap=True)
    for cells in rows:
        table.add_row(*cells)
    if fits(console, table):
        console.print(table)
    else:
        table_or_records(console, "ffctl doctor", columns, rows, one_line=True)
    for r in reports:
        for problem in r.problems():
            line = problem if problem.startswith(r.host) else f"{r.host}: {problem}"
            style = "red" if not r.can_run_job else "yellow"
            console.print(f"[{style}]{escape(line)}[/{style}]", highlight=False)  # wrapped, never cut
