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
        # Folded, never cut: a narrow terminal or a pipe gets every value whole.
        faults.add_column(col, justify="left" if col in ("fault", "kind", "target", "source") else "right",
                          overflow="fold")
    phases = Table(title="recovery breakdown (s)", title_justify="left")
    for col in ("fault", "detect", "decide", "spawn", "rendezvous", "restore", "replay", "started"):
        phases.add_column(col, justify="left" if col in ("fault", "started") else "right", overflow="fold")
    for f in report["faults"]:
        faults.add_row(
            f["fault_id"], f["kind"], f["target"], str(f["at_step"]), _s(f["detection_s"]),
            _s(f["recovery_s"]) if f["recovered"] else "[red]not recovered[/red]",
            str(f["lost_steps"]), f["restore_source"] or "-", f"{f['lost_gpu_hours']:.6f}",
            "yes" if f["emulated"] else "no",
        )
        b = f["breakdown"]
        # How the replacements started: a warm spare, a fork of the agent's template, or a
        # fresh interpreter (cold).
        started = ",".join(sorted(set((f.get("started_by") or {}).values()))) or "-"
        phases.add_row(f["fault_id"], *(_s(b.get(k)) for k in ("detect", "decide", "spawn", "rendezvous", "restore", "replay")),
                       started)
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
    for line in status_notes(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def status_notes(report: dict[str, Any]) -> list[str]:
    """What a run whose controller was lost still tells: that its figures stop where the
    controller died, which faults the dead man's switches reverted, and what is left behind."""
    lines = [
        f"{f['fault_id']}: reverted by the dead man's switch"
        + ("" if f.get("revert_ok") else " (a revert command failed: check with `ffctl inject revert --all`)")
        for f in report["faults"] if f.get("reverted_by") == "deadman"
    ]
    if report["status"] != "incomplete":
        return lines
    lines.insert(0, f"incomplete: {report.get('reason') or 'controller lost'}; the record stops at the "
                    "controller's last event")
    left = report.get("left") or {}
    parts = []
    if left.get("namespaces"):
        parts.append("network namespaces " + ", ".join(left["namespaces"]))
    if left.get("links"):
        parts.append("links " + ", ".join(left["links"]))
    if parts:
        lines.append(f"left: {'; '.join(parts)}; remove with `{left.get('remove')}`")
    return lines


def root_cause_lines(cause: dict[str, Any], title: str) -> list[str]:
    """The root cause of a failed run, laid out as torchrun prints it: the first failed rank,
    its host, exit code or signal, time, and the last lines of its error."""
    import datetime

    bar, rule = "=" * 72, "-" * 72
    lines = [bar, title, rule, "Root Cause (first observed failure):"]
    t = cause.get("t")
    if isinstance(t, (int, float)):
        stamp = datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="milliseconds")
        lines.append(f"  time      : {stamp}")
    if cause.get("rank") is None:
        lines.append(f"  failure   : {cause.get('summary') or cause.get('cause')}")
    else:
        lines.append(f"  host      : {cause.get('host') or '-'}")
        lines.append(f"  rank      : {cause['rank']} (node {cause.get('node')})")
        if cause.get("step") is not None:
            lines.append(f"  step      : {cause['step']}")
        code, sig, pid = cause.get("exitcode"), cause.get("signal"), cause.get("pid")
        pid_text = f"pid: {pid}" if pid else "pid: -"
        if code is None:
            lines.append(f"  exitcode  : - (raised in the step; {pid_text})")
        elif sig:
            lines.append(f"  exitcode  : {code} (signal {sig}; {pid_text})")
        else:
            lines.append(f"  exitcode  : {code} ({pid_text})")
        lines.append(f"  error     : {cause.get('error') or '-'}")
        tail = [str(x) for x in cause.get("tail") or []]
        if tail:
            lines.append("  last lines of its error or log:")
            lines += [f"    {x}" for x in tail]
    others = cause.get("others") or []
    if others:
        lines.append(rule)
        lines.append("Other failures:")
        lines += [f"  {x}" for x in others]
    lines.append(bar)
    return lines


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
