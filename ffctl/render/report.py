"""`ffctl report` rendering: a run's summary and a block per fault, the list of runs, runs
side by side, and the same as GitHub-flavoured Markdown.

Terminal output never cuts or folds a value: tables are used where they fit the console's width
(80 columns when output is not a terminal) and fall back to one block of `field: value` lines per
row where they do not, and a comparison too wide for one table is split into tables of fewer runs.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from rich.console import Console
from rich.padding import Padding

from ffctl.render.tables import fits, grid, key_values, table_or_records

BREAKDOWN = ("detect", "decide", "spawn", "rendezvous", "restore", "replay")


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _gpu_h(value: float | None) -> str:
    """GPU-hours: a chaos run's are tiny; six decimals, or two significant digits below that."""
    if value is None:
        return "-"
    if value == 0 or abs(value) >= 1e-6:
        return f"{value:.6f}"
    return f"{value:.2e}"


def started_text(fault: dict[str, Any]) -> str:
    """How the replacements started: a warm spare, a fork of the agent's template, or a fresh
    interpreter (cold), and "(ahead)" when before the recovery's decision; per rank when they
    differ."""
    ahead = {str(r) for r in fault.get("started_ahead") or []}
    by = {r: f"{how} (ahead)" if str(r) in ahead else str(how) for r, how in (fault.get("started_by") or {}).items()}
    kinds = sorted(set(by.values()))
    if not kinds:
        return "-"
    if len(kinds) == 1:
        return kinds[0]
    return ", ".join(f"rank {r}: {by[r]}" for r in sorted(by, key=lambda r: (len(str(r)), str(r))))


def _step_of(f: dict[str, Any]) -> str:
    """The step a fault hit; "-" in a script that reports no steps (its step is unknown, not 0)."""
    return str(f["at_step"]) if f.get("step_known", True) else "-"


def _lost_steps(f: dict[str, Any]) -> str:
    # None: unknown (a script that reported no step around the fault), never shown as 0.
    return "-" if f.get("lost_steps") is None else str(f["lost_steps"])


def _total_lost_steps(faults: list[dict[str, Any]]) -> str:
    """The faults' lost steps added up; "-" when any is unknown (the sum would be a guess)."""
    if any(f.get("lost_steps") is None for f in faults):
        return "-"
    return str(sum(int(f["lost_steps"]) for f in faults))


def straggler_text(f: dict[str, Any]) -> str:
    """The slow ranks the straggler detector named for a fault: `rank 1 3.1x from step 11, named
    at step 12, 6.52s lost waiting for it`; one per rank, joined with `; `."""
    parts = []
    for x in f.get("stragglers") or []:
        factor = x.get("factor")
        text = f"rank {x.get('rank')} {factor:.1f}x" if isinstance(factor, (int, float)) else f"rank {x.get('rank')}"
        text += f" from step {x.get('onset_step')}, named at step {x.get('step')}"
        if x.get("lost_s") is not None:
            text += f", {_s(x['lost_s'])}s lost waiting for it"
        parts.append(text)
    return "; ".join(parts)


def fault_fields(f: dict[str, Any]) -> list[tuple[str, str]]:
    """One fault's figures, as the report shows them (terminal and Markdown alike)."""
    reverted = f.get("reverted_by") or "-"
    if f.get("reverted_by") and f.get("revert_ok") is False:
        reverted += " (a revert command failed)"
    return [
        ("kind", str(f["kind"])),
        ("target", str(f["target"])),
        ("step", _step_of(f)),
        ("detection s", _s(f.get("detection_s")) if f.get("detection_s") is not None else "not detected"),
        ("recovery s", _s(f.get("recovery_s")) if f.get("recovered") else "not recovered"),
        ("lost s", _s(f.get("lost_s"))),
        ("lost steps", _lost_steps(f)),
        ("lost GPU-h", _gpu_h(f.get("lost_gpu_hours"))),
        ("restore source", f.get("restore_source") or "-"),
        ("restore check", f.get("restore_check") or "-"),
        ("landed", landed_text(f.get("landed"))),
        ("copies refused", "; ".join(f.get("rejected_copies") or []) or "-"),
        ("started by", started_text(f)),
        ("emulated", "yes" if f.get("emulated") else "no"),
        ("reverted by", reverted),
        ("straggler", straggler_text(f) or "-"),
    ]


def _steps_done(report: dict[str, Any]) -> str:
    # A plain script that reported no steps trained an unknown number of them, not 0.
    return str(report["steps_completed"]) if report.get("step_known", True) else "-"


def summary_fields(report: dict[str, Any]) -> list[tuple[str, str]]:
    lost_s = sum(float(f.get("lost_s") or 0.0) for f in report.get("faults", []))
    return [
        ("run", str(report["run_id"])),
        ("status", str(report["status"])),
        ("strategy", str(report["strategy"] or "-")),
        ("world size", str(report["world_size"])),
        ("steps", _steps_done(report)),
        ("final loss", _s(report.get("final_loss"), 4)),
        ("goodput", _s(report.get("goodput"), 3)),
        ("wall time s", _s(report.get("wall_s"))),
        ("faults", str(len(report.get("faults", [])))),
        ("lost s", _s(lost_s)),
        ("lost GPU-hours", _gpu_h(report.get("lost_gpu_hours_total"))),
        ("spare GPU-hours", _gpu_h(report.get("spare_gpu_hours"))),
        # Shown only when it happened: each window is a protection_lost event in the record.
        *([("unprotected s", f"{_s(report['unprotected_s'])} (state with no copy on another node)")]
          if report.get("unprotected_s") else []),
        # Shown only when something was refused: each is a message_rejected event in the record.
        *([("rejected messages", f"{report['messages_rejected']} (message_rejected in events.jsonl)")]
          if report.get("messages_rejected") else []),
    ]


def run_row(report: dict[str, Any]) -> dict[str, str]:
    """A run as one line of `ffctl report` without a run id."""
    return {
        "run": str(report["run_id"]), "status": str(report["status"]),
        "strategy": str(report["strategy"] or "-"), "world": str(report["world_size"]),
        "steps": _steps_done(report), "faults": str(len(report.get("faults", []))),
        "lost GPU-h": _gpu_h(report.get("lost_gpu_hours_total")),
    }


FAULT_OVERVIEW = ["fault", "kind", "target", "step", "recover s", "lost s"]


def fault_overview_rows(faults: list[dict[str, Any]]) -> list[list[str]]:
    """The faults at a glance, a row per fault under FAULT_OVERVIEW."""
    return [[f["fault_id"], f["kind"], f["target"], _step_of(f),
             _s(f.get("recovery_s")) if f.get("recovered") else "not recovered", _s(f.get("lost_s"))]
            for f in faults]


def breakdown_row(fault: dict[str, Any]) -> list[str]:
    """A fault's recovery phases in seconds, under BREAKDOWN."""
    b = fault.get("breakdown") or {}
    return [_s(b.get(k)) for k in BREAKDOWN]


def render_report(report: dict[str, Any], console: Console) -> None:
    """A run's summary, its faults at a glance, then each fault's figures and recovery breakdown."""
    console.print(key_values("summary", summary_fields(report)))
    faults = report.get("faults") or []
    if faults:
        console.print()
        table_or_records(console, "faults", FAULT_OVERVIEW, fault_overview_rows(faults), left=3)
    for f in faults:
        console.print()
        console.print(key_values(f"fault {f['fault_id']}", fault_fields(f)))
        table_or_records(console, f"fault {f['fault_id']}: recovery breakdown (s)", list(BREAKDOWN),
                         [breakdown_row(f)], left=0)
    for m in report.get("missed_faults") or []:  # asked for, never took effect: the run tested less
        if isinstance(m, dict):
            console.print(f"fault {m.get('fault_id')} MISSED ({m.get('kind')} {m.get('target')} {m.get('trigger')}): "
                          f"{m.get('reason')}", markup=False, highlight=False, soft_wrap=True)
    for line in status_notes(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def render_run_list(reports: list[dict[str, Any]], console: Console, runs_dir: str) -> None:
    """The runs of a runs directory, newest first."""
    if not reports:
        console.print(f"no runs in {runs_dir}", markup=False, highlight=False)
        return
    rows = [run_row(r) for r in reports]
    headers = list(rows[0])
    table_or_records(console, f"runs in {runs_dir} (newest first)", headers,
                     [list(r.values()) for r in rows], left=3, one_line=True)


COMPARE_FIELDS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("status", lambda r: str(r["status"])),
    ("strategy", lambda r: str(r["strategy"] or "-")),
    ("world size", lambda r: str(r["world_size"])),
    ("steps", _steps_done),
    ("final loss", lambda r: _s(r.get("final_loss"), 4)),
    ("goodput", lambda r: _s(r.get("goodput"), 3)),
    ("faults", lambda r: str(len(r.get("faults") or []))
     + (f" ({len(r['missed_faults'])} missed)" if isinstance(r.get("missed_faults"), list) and r["missed_faults"] else "")),
    ("max recovery s", lambda r: _s(max((f["recovery_s"] for f in r.get("faults") or []
                                         if f.get("recovery_s") is not None), default=None))),
    ("lost s", lambda r: _s(sum(float(f.get("lost_s") or 0.0) for f in r.get("faults") or []))),
    ("lost steps", lambda r: _total_lost_steps(r.get("faults") or [])),
    ("lost GPU-hours", lambda r: _gpu_h(r.get("lost_gpu_hours_total"))),
    ("spare GPU-hours", lambda r: _gpu_h(r.get("spare_gpu_hours"))),
]


def comparison_rows(reports: list[dict[str, Any]]) -> list[list[str]]:
    return [[name] + [get(r) for r in reports] for name, get in COMPARE_FIELDS]


def render_comparison(reports: list[dict[str, Any]], console: Console) -> None:
    """Runs side by side: a row per figure, a column per run. Runs that do not fit one table's
    width go on to the next table, so every run id and value stays whole."""
    start = 0
    while start < len(reports):
        end = len(reports)
        while True:
            group = reports[start:end]
            table = grid("runs compared" if start == 0 else None, ["run"] + [r["run_id"] for r in group],
                          comparison_rows(group))
            if end - start == 1 or fits(console, table):
                break
            end -= 1
        if start > 0:
            console.print()
        if end - start == 1 and not fits(console, table):
            console.print(key_values(f"run {group[0]['run_id']}", [(n, g(group[0])) for n, g in COMPARE_FIELDS]))
        else:
            console.print(table)
        start = end
    for r in reports:
        for line in status_notes(r):
            console.print(f"{r['run_id']}: {line}", markup=False, highlight=False, soft_wrap=True)


# --- `ffctl project`: measured costs projected to a fleet ----------------------------------


def _mtbf_text(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def _sig(value: float | None) -> str:
    """Three significant digits, and whole numbers with thousands separators from 100 on."""
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _n(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def fleet_title(doc: dict[str, Any]) -> str:
    """The fleet projected to, in one line."""
    fleet = doc["fleet"]
    if fleet["failures_per_1000_node_days"] is not None:
        rate = (f"{fleet['failures_per_1000_node_days']:.3g} failures per 1,000 node-days, "
                f"{fleet['gpus_per_node']} GPUs per node")
    elif fleet["mtbf_gpus"] is not None:
        rate = f"MTBF {_mtbf_text(fleet['mtbf_s'])} at {fleet['mtbf_gpus']:,} GPUs, scaled by the GPU count"
    else:
        rate = f"MTBF {_mtbf_text(fleet['mtbf_s'])} at every GPU count"
    return f"projected to fleet {fleet['name']}: {rate}; {doc['spares_per_1000']:g} spare GPUs per 1,000"


def fleet_notes(doc: dict[str, Any]) -> list[str]:
    """What the rate counts and where it comes from, which ETTR is the headline, and what each
    strategy's inputs lacked."""
    fleet = doc["fleet"]
    lines = [f"population: {fleet['population']}"]
    if fleet.get("source"):
        lines.append(f"source: {fleet['source']}")
    lines.append("headline ETTR: Daly's complete model (\"ETTR Daly\"); the first-order form beside it")
    if doc.get("replace_s"):
        lines.append(f"without a spare, a node takes {doc['replace_s']:g} s to replace")
    return lines + list(doc["notes"])


PROJECTION_HEADERS = ["GPUs", "MTBF h", "ETTR Daly", "ETTR 1st", "lost GPU-h/d", "spare GPU-h/d", "ckpt s"]


def fleet_rows(strategy: dict[str, Any]) -> list[list[str]]:
    """A strategy's projection, a row per GPU count under PROJECTION_HEADERS."""
    # ETTR to 4 places: at fleet scale 0.9996 against 0.994 is thousands of GPU-hours a day.
    return [[f"{p['gpus']:,}", _sig(p["mtbf_h"]), _s(p["ettr_daly"], 4), _s(p["ettr_first_order"], 4),
             _n(p["lost_gpu_hours_per_day"]), _n(p["spare_gpu_hours_per_day"]), _n(p["ckpt_interval_s"])]
            for p in strategy["projections"]]


def _by_kind_rows(doc: dict[str, Any], key: str, label: str) -> list[list[str]]:
    kinds = sorted({k for s in doc["strategies"] for k in s["inputs"][key]})
    rows = []
    for kind in kinds:
        for which, said in (("with_spare", "spare"), ("without_spare", "no spare")):
            cells = [_s((s["inputs"][key].get(kind) or {}).get(which)) for s in doc["strategies"]]
            if any(c != "-" for c in cells):
                rows.append([f"{label} {kind}, {said}"] + cells)
    return rows


INPUT_FIELDS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("runs", lambda s: str(len(s["runs"]))),
    ("step s", lambda s: _s(s["inputs"]["step_s"], 4)),
    ("snapshot overhead", lambda s: _s(s["inputs"]["snapshot_overhead"], 3)),
    ("blocking save s", lambda s: _s(s["inputs"]["blocking_save_s"], 3)),
    ("checkpoint write s", lambda s: _s(s["inputs"]["ckpt_write_s"], 3)),
    ("detection s", lambda s: _s(s["inputs"]["detection_s"])),
    ("faults used", lambda s: str(s["inputs"]["faults"])),
    ("R s", lambda s: _s(s["projections"][0]["restart_s"]) if s["projections"] else "-"),
]


def input_rows(doc: dict[str, Any]) -> list[list[str]]:
    """What each strategy's runs measured, a column per strategy."""
    rows = [[name] + [get(s) for s in doc["strategies"]] for name, get in INPUT_FIELDS]
    return rows + _by_kind_rows(doc, "lost_s_by_kind", "lost s")


def render_fleet_projection(doc: dict[str, Any], console: Console) -> None:
    """The measured inputs per strategy, a table per strategy, then notes and the formulas."""
    # Prose is word-wrapped to the console (80 columns in a pipe); the tables never cut a value.
    console.print(fleet_title(doc), style="bold", markup=False, highlight=False)
    headers = ["measured"] + [s["strategy"] for s in doc["strategies"]]
    table_or_records(console, "inputs from the runs", headers, input_rows(doc))
    for strategy in doc["strategies"]:
        console.print()
        table_or_records(console, strategy["strategy"], PROJECTION_HEADERS, fleet_rows(strategy), left=0)
    console.print()
    for line in fleet_notes(doc):
        console.print(line, markup=False, highlight=False)
    console.print()
    console.print("formulas (docs/projection.md):", markup=False, highlight=False)
    for line in doc["formulas"]:
        console.print(Padding(line, (0, 0, 0, 2), expand=False), markup=False, highlight=False)


def render_run_check(doc: dict[str, Any], console: Console) -> None:
    """`ffctl project --check`: a run's goodput as predicted from single-fault runs, and as measured."""
    kinds = ", ".join(f"{n} {k}" for k, n in doc["faults_by_kind"].items()) or "none"
    rows = [
        ["faults", f"{doc['faults']} ({kinds})"],
        ["wall s", _s(doc["wall_s"])],
        ["MTBF s", _s(doc["mtbf_s"])],
        ["lost s per fault predicted", _s(doc["lost_s_per_fault_predicted"])],
        ["lost s per fault measured", _s(doc["lost_s_per_fault_measured"])],
        ["ETTR predicted", f"{doc['ettr_predicted']:.3f}"],
        ["ETTR measured", f"{doc['ettr_measured']:.3f}"],
        ["difference (points)", f"{doc['difference_points']:+.1f}"],
        ["goodput predicted", "-" if doc["goodput_predicted"] is None else f"{doc['goodput_predicted']:.3f}"],
        ["goodput measured", f"{doc['goodput_measured']:.3f}"],
    ]
    if doc["within_points"] is not None:
        rows.append([f"within {doc['within_points']:g} points", "yes" if doc["ok"] else "NO"])
    title = f"run {doc['run']} ({doc['strategy']}) predicted from {', '.join(doc['from_runs'])}"
    table_or_records(console, title, ["", "value"], rows)
    if doc["unpredicted_faults"]:
        console.print(f"faults of a kind no single-fault run measured, taken as measured: "
                      f"{', '.join(doc['unpredicted_faults'])}", markup=False, highlight=False)
    console.print("formulas (docs/projection.md):", markup=False, highlight=False)
    for line in doc["formulas"]:
        console.print(Padding(line, (0, 0, 0, 2), expand=False), markup=False, highlight=False)


# --- Markdown (GitHub-flavoured), for CI summaries ------------------------------------------


def _md_cell(value: str) -> str:
    return value.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _numeric(cell: str) -> bool:
    return cell == "-" or re.fullmatch(r"-?[0-9][0-9.e+-]*", cell) is not None


def md_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """A GitHub-flavoured table; past the first `left` columns, numeric ones align right."""
    right = [i >= left and bool(rows) and all(_numeric(row[i]) for row in rows) for i in range(len(headers))]
    lines = ["| " + " | ".join(_md_cell(h) for h in headers) + " |",
             "|" + "|".join(" ---: " if r else " --- " for r in right) + "|"]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_report(report: dict[str, Any]) -> str:
    parts = [f"### ffctl run `{report['run_id']}`", "",
             md_table(["", "value"], [[k, v] for k, v in summary_fields(report)[1:]])]
    faults = report.get("faults") or []
    if faults:
        headers = ["fault"] + [k for k, _ in fault_fields(faults[0])]
        parts += ["", "#### Faults", "",
                  md_table(headers, [[f["fault_id"]] + [v for _, v in fault_fields(f)] for f in faults], left=3)]
        parts += ["", "#### Recovery breakdown (s)", "",
                  md_table(["fault"] + list(BREAKDOWN), [[f["fault_id"]] + breakdown_row(f) for f in faults])]
    notes = status_notes(report)
    if notes:
        parts += [""] + [f"> {line}" for line in notes]
    return "\n".join(parts) + "\n"


def markdown_run_list(reports: list[dict[str, Any]]) -> str:
    if not reports:
        return "No runs.\n"
    rows = [run_row(r) for r in reports]
    return md_table(list(rows[0]), [list(r.values()) for r in rows], left=3) + "\n"


def markdown_comparison(reports: list[dict[str, Any]]) -> str:
    return md_table(["run"] + [f"`{r['run_id']}`" for r in reports], comparison_rows(reports)) + "\n"


def markdown_fleet_projection(doc: dict[str, Any]) -> str:
    parts = [f"### {fleet_title(doc)}", "",
             md_table(["measured"] + [s["strategy"] for s in doc["strategies"]], input_rows(doc))]
    for strategy in doc["strategies"]:
        parts += ["", f"#### {strategy['strategy']}", "", md_table(PROJECTION_HEADERS, fleet_rows(strategy), left=0)]
    parts += [""] + [f"- {line}" for line in fleet_notes(doc)]
    parts += ["", "Formulas (docs/projection.md):", ""] + [f"- `{line}`" for line in doc["formulas"]]
    return "\n".join(parts) + "\n"


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


def _seconds_of(value: Any) -> str:
    return f"{value:.1f}s" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


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
        if cause.get("lingered_s") is not None:  # the barrier stopped it: it had not failed
            lingered = _seconds_of(cause["lingered_s"])
            if cause.get("cause") == "silence":
                lines.append(f"  silent    : {lingered} (no rank printed a line or committed a step)")
            else:
                lines.append(f"  lingered  : {lingered} after the other ranks finished")
            lines.append(f"  last line : {cause.get('last_line') or '-'}")
            if cause.get("stacks_file"):
                lines.append(f"  stacks in : {cause['stacks_file']}")
        elif code is None:
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
        stacks = [str(x) for x in cause.get("stacks") or []]
        if stacks:
            lines.append("  its Python stacks when it was stopped:")
            lines += [f"    {x}" for x in stacks]
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


def landed_text(landed: Any) -> str:
    """Where a fault landed: a phase kill's step and phase, or each holder's corrupted replicas."""
    if not isinstance(landed, dict):
        return "-"
    if isinstance(landed.get("replicas"), dict):
        return "; ".join(f"node {n}'s replicas of step(s) {', '.join(map(str, steps or [])) or 'none'}"
                         for n, steps in sorted(landed["replicas"].items()))
    return f"step {landed.get('step')}, {landed.get('phase')}"
