"""`ffctl report --html FILE` and `ffctl project --html FILE`: self-contained HTML pages with the
tables and plots.

A report page holds the tables of the terminal report (summary, faults, each fault's figures and
recovery breakdown, notes; runs side by side when there are several) and, per run, two
matplotlib figures embedded as base64 PNG: a timeline of the job's progress (steps per second)
with each fault's recovery phases shaded, and the loss curve with a marker at every fault. A
projection page holds ETTR against GPU count (a line per strategy, the preset fleets marked),
the projection's tables, notes and formulas. Nothing is fetched when a page opens, so it can be
attached to a CI job or mailed as it is.

matplotlib is an optional extra (`pip install 'ffctl[html]'`): it is imported only here, only
when a page is drawn, and with the Agg backend so no display is needed. ffctl's own code never
imports numpy; matplotlib brings it with itself.
"""
from __future__ import annotations

import base64
import html
import io
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from ffctl.exits import BadInput
from ffctl.render.report import (BREAKDOWN, FAULT_OVERVIEW, PROJECTION_HEADERS, breakdown_row, comparison_rows,
                                 fault_fields, fault_overview_rows, fleet_notes, fleet_rows, fleet_title, input_rows,
                                 run_row, status_notes, summary_fields)
from runs.events import Event, EventKind

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

INSTALL_HINT = "pip install 'ffctl[html]'"

# Okabe-Ito colours (distinguishable with the common colour-vision deficiencies), one per phase.
PHASE_COLOURS: dict[str, str] = {
    "detect": "#E69F00",
    "decide": "#F0E442",
    "spawn": "#CC79A7",
    "rendezvous": "#56B4E9",
    "restore": "#009E73",
    "replay": "#0072B2",
    "fault active": "#D55E00",
    "back to pace": "#999999",
    "not recovered": "#000000",
}
# The progress timeline: sampled at about this many points across the training, each sample the
# steps gained over a window centred on it of WINDOW_GAPS median step intervals (commits are
# reported in bursts, so a single interval is no rate), at least 1/SAMPLES of the training.
TIMELINE_SAMPLES = 400
WINDOW_GAPS = 2.0


def require_matplotlib() -> None:
    """Fail with one line before anything is read or written when the `html` extra is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BadInput(f"--html needs matplotlib, which is not installed: {INSTALL_HINT}") from None


# --- What the plots show, as plain data (no matplotlib) ----------------------------------------


@dataclass(frozen=True)
class Span:
    """A stretch of a fault's life on the run's clock: a recovery phase, or the fault being active."""

    fault_id: str
    phase: str
    start: float
    end: float


def fault_spans(fault: dict[str, Any], end_t: float) -> list[Span]:
    """A fault's shaded stretches on the timeline (controller clock), from its report figures.

    A detected fault shows its recovery phases one after the other from the injection (detect,
    decide, spawn, rendezvous, restore, replay: the breakdown, which adds up to recovery_s), and
    `not recovered` up to the record's end when nothing brought it back. A fault no detector saw
    (a slowdown, a short hang) shows `fault active` until it was reverted or the job got past it.
    Either way `back to pace` follows, up to when the job was back at its pace before the fault."""
    fid = str(fault["fault_id"])
    t = float(fault["injected_at"])
    spans: list[Span] = []
    if fault.get("detected_at") is not None:
        breakdown = fault.get("breakdown") or {}
        for phase in BREAKDOWN:
            d = breakdown.get(phase)
            if d is None:
                continue
            spans.append(Span(fid, phase, t, t + float(d)))
            t += float(d)
        if not fault.get("recovered"):
            spans.append(Span(fid, "not recovered", t, max(t, end_t)))
            return spans
    else:
        ends = [float(x) for x in (fault.get("resumed_at"), fault.get("reverted_at")) if x is not None]
        active_end = max(ends) if ends else end_t
        spans.append(Span(fid, "fault active", t, max(t, active_end)))
        t = max(t, active_end)
    back = fault.get("back_at_pace_at")
    if back is not None and float(back) > t:
        spans.append(Span(fid, "back to pace", t, float(back)))
    return spans


@dataclass(frozen=True)
class Timeline:
    """Progress over time: at each of `times` (controller clock), `rates` steps per second, the
    steps gained over a `window` of seconds centred there. Progress is the highest step committed
    so far, so a step replayed after a rollback is no progress."""

    times: list[float]
    rates: list[float]
    window: float


def progress_timeline(events: Iterable[Event], end_t: float | None = None,
                      samples: int = TIMELINE_SAMPLES) -> Timeline:
    """Steps per second over the training: from the first step's start to the last commit, or to
    `end_t` when later (the end of an incomplete run's record: its stall shows as no progress)."""
    commits = sorted((ev.t, int(ev.get("step")), float(ev.get("step_time_s") or 0.0))
                     for ev in events if ev.kind is EventKind.STEP)
    if not commits:
        return Timeline([], [], 0.0)
    start = commits[0][0] - commits[0][2]
    stop = max(commits[-1][0], end_t if end_t is not None else commits[-1][0])
    # (t, high-water step, that step's own time) at each new high.
    marks: list[tuple[float, int, float]] = [(start, 0, 0.0)]
    for t, step, took in commits:
        if step > marks[-1][1]:
            marks.append((t, step, took))
    gaps = [b[0] - a[0] for a, b in zip(marks[1:], marks[2:]) if b[0] > a[0]]
    span = max(stop - start, 1e-9)
    window = max(span / samples, WINDOW_GAPS * statistics.median(gaps)) if gaps else span / 10
    times = [start + span * i / samples for i in range(samples + 1)]

    def high_at(t: float) -> float:
        # A step is worked on during its own step time before its commit: progress climbs over
        # that stretch and stands still before it (a stall), never before the previous commit.
        if t <= marks[0][0]:
            return 0.0
        for (ta, sa, _), (tb, sb, took) in zip(marks, marks[1:]):
            if t < tb:
                begin = max(ta, tb - took) if took > 0 else ta
                return sa + (sb - sa) * (t - begin) / (tb - begin) if t > begin else float(sa)
        return float(marks[-1][1])

    rates = [(high_at(t + window / 2) - high_at(t - window / 2)) / window for t in times]
    return Timeline(times, rates, window)


def run_start(events: list[Event]) -> float:
    for ev in events:
        if ev.kind is EventKind.RUN_STARTED:
            return ev.t
    return events[0].t if events else 0.0


def record_end(events: list[Event]) -> float:
    """The controller's last event (a dead man's switch reporting later says nothing of the job)."""
    own = [ev.t for ev in events if ev.get("by") != "deadman"]
    return max(own) if own else 0.0


# --- Figures --------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display: the figures only ever become PNG bytes
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    # No timestamp in the PNG: the same run gives the same bytes.
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    _pyplot().close(fig)
    return buf.getvalue()


def _label_faults(ax: Axes, xs: list[tuple[float, str]]) -> None:
    """Each fault's id and kind above the plot, at its x (a transform keeps them over the axes)."""
    for x, text in xs:
        ax.annotate(text, xy=(x, 1.0), xycoords=("data", "axes fraction"), xytext=(2, 3),
                    textcoords="offset points", fontsize=8, rotation=0, ha="left", va="bottom")


def timeline_png(report: dict[str, Any], events: list[Event]) -> bytes:
    """Steps per second over the run's time, each fault's phases shaded, the pace before the
    first fault dashed."""
    plt = _pyplot()
    t0, end_t = run_start(events), record_end(events)
    # A completed run's shutdown after its last step is no stall; any other run's end is.
    line = progress_timeline(events, None if report.get("status") == "completed" else end_t)
    fig, ax = plt.subplots(figsize=(10, 3.6))
    faults = report.get("faults") or []
    if line.rates:
        xs = [t - t0 for t in line.times]
        ax.plot(xs, line.rates, color="#222222", linewidth=1.2,
                label=f"steps/s (over {line.window:.2g} s)")
        ax.set_xlim(xs[0], xs[-1])
    else:
        ax.text(0.5, 0.5, "no step was recorded", transform=ax.transAxes, ha="center", va="center")
    pace = next((f.get("pace_s") for f in faults if f.get("pace_s")), None)
    if pace:
        ax.axhline(1.0 / float(pace), color="#555555", linestyle="--", linewidth=0.8,
                   label="pace before the first fault")
    shown: set[str] = set()
    for f in faults:
        for span in fault_spans(f, end_t):
            ax.axvspan(span.start - t0, span.end - t0, color=PHASE_COLOURS[span.phase], alpha=0.35, linewidth=0,
                       label=None if span.phase in shown else span.phase)
            shown.add(span.phase)
        ax.axvline(float(f["injected_at"]) - t0, color="#D55E00", linewidth=1.0)
    _label_faults(ax, [(float(f["injected_at"]) - t0, f"{f['fault_id']} {f['kind']}") for f in faults])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("steps/s")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def loss_png(report: dict[str, Any]) -> bytes:
    """The loss of every step as the job finally committed it, a marker at each fault's step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.6))
    pairs = report.get("loss_by_step") or []
    losses = {int(s): float(v) for s, v in pairs if v is not None}
    if losses:
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], color="#0072B2", linewidth=1.2, label="loss")
    else:
        ax.text(0.5, 0.5, "no loss was recorded", transform=ax.transAxes, ha="center", va="center")
    faults = report.get("faults") or []
    for i, f in enumerate(faults):
        step = int(f["at_step"])
        ax.axvline(step, color="#D55E00", linewidth=1.0, linestyle="--", label="fault" if i == 0 else None)
        if step in losses:
            ax.plot([step], [losses[step]], marker="o", color="#D55E00", markersize=5)
    _label_faults(ax, [(float(f["at_step"]), f"{f['fault_id']} {f['kind']}") for f in faults])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    return _png(fig)


# --- The page -------------------------------------------------------------------------------

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; color: #1b1b1b; margin: 24px auto; max-width: 1180px; padding: 0 16px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin-top: 20px; }
table { border-collapse: collapse; margin: 8px 0 16px; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e4e4e4; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.kv th { background: none; font-weight: 600; }
figure { margin: 12px 0 20px; } figcaption { color: #555; font-size: 13px; }
img { max-width: 100%; height: auto; }
.note { background: #fff6e0; border-left: 4px solid #E69F00; padding: 6px 10px; margin: 6px 0; }
code { font-size: 13px; }
"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _numeric(cell: str) -> bool:
    try:
        float(cell.replace(",", ""))
    except ValueError:
        return cell == "-"
    return True


def kv_table(fields: list[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in fields)
    return f'<table class="kv">{rows}</table>'


def grid_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{_e(c)}</td>' if i >= left and _numeric(c) else f"<td>{_e(c)}</td>"
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _figure(png: bytes, alt: str, caption: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{_e(alt)}">'
            f"<figcaption>{_e(caption)}</figcaption></figure>")


def _notes(lines: list[str]) -> str:
    return "".join(f'<p class="note">{_e(line)}</p>' for line in lines)


def run_section(report: dict[str, Any], events: list[Event], heading: str = "h2") -> str:
    """One run: the terminal report's tables, then its timeline and loss curve."""
    rid = report["run_id"]
    parts = [f"<{heading}>run {_e(rid)}</{heading}>", _notes(status_notes(report)),
             "<h3>summary</h3>", kv_table(summary_fields(report))]
    faults = report.get("faults") or []
    parts.append(_figure(timeline_png(report, events), f"timeline of run {rid}",
                         "Progress in steps per second; each fault's recovery phases shaded (detect, decide, "
                         "spawn, rendezvous, restore, replay), a fault no detector saw shaded while active, "
                         "then the time until the job was back at its pace before the fault."))
    parts.append(_figure(loss_png(report), f"loss curve of run {rid}",
                         "Loss of every step as the job finally committed it; a dashed line at each fault's step."))
    if faults:
        parts += ["<h3>faults</h3>", grid_table(FAULT_OVERVIEW, fault_overview_rows(faults), left=3)]
    for f in faults:
        parts += [f"<h3>fault {_e(f['fault_id'])}</h3>", kv_table(fault_fields(f)),
                  "<p>recovery breakdown (s)</p>", grid_table(list(BREAKDOWN), [breakdown_row(f)], left=0)]
    return "".join(parts)


def document(title: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{_STYLE}</style></head><body><h1>{_e(title)}</h1>{body}</body></html>\n")


def report_html(reports: list[dict[str, Any]], events: dict[str, list[Event]]) -> str:
    """The page for one run, or for several: side by side first, then each run on its own."""
    if len(reports) == 1:
        return document(f"ffctl report: {reports[0]['run_id']}", run_section(reports[0], events[reports[0]["run_id"]]))
    body = ["<h2>runs compared</h2>",
            grid_table(["run"] + [r["run_id"] for r in reports], comparison_rows(reports))]
    body += [run_section(r, events[r["run_id"]]) for r in reports]
    return document(f"ffctl report: {len(reports)} runs", "".join(body))


# Okabe-Ito again: a colour and a marker per strategy, a marker per preset fleet.
STRATEGY_STYLES: dict[str, tuple[str, str]] = {
    "peer": ("#0072B2", "o"), "restart-memory": ("#009E73", "s"), "restart-disk": ("#D55E00", "^"),
}
PRESET_MARKERS = ("D", "P", "X", "v", "*")


def ettr_png(doc: dict[str, Any]) -> bytes:
    """ETTR (Daly's complete model) against GPU count on a log axis: a line per strategy for the
    fleet asked, points at the counts asked, and each preset fleet at the size it was measured at,
    every strategy's ETTR there under that preset's rate."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for i, strategy in enumerate(doc["strategies"]):
        colour, marker = STRATEGY_STYLES.get(strategy["strategy"], (f"C{i}", "o"))
        curve = [(c["gpus"], c["ettr_daly"]) for c in strategy["curve"] if c["ettr_daly"] is not None]
        if not curve:
            continue
        ax.plot([g for g, _ in curve], [e for _, e in curve], color=colour, linewidth=1.6,
                label=f"{strategy['strategy']}")
        asked = [(p["gpus"], p["ettr_daly"]) for p in strategy["projections"] if p["ettr_daly"] is not None]
        ax.plot([g for g, _ in asked], [e for _, e in asked], linestyle="none", marker=marker, color=colour)
    shown: list[float] = [c["ettr_daly"] for s in doc["strategies"] for c in s["curve"] if c["ettr_daly"] is not None]
    for j, preset in enumerate(doc.get("presets") or []):
        marker = PRESET_MARKERS[j % len(PRESET_MARKERS)]
        ax.axvline(preset["gpus"], color="#999999", linestyle=":", linewidth=0.8)
        # A grey stand-in carries the legend entry: the markers themselves take each strategy's colour.
        ax.plot([], [], linestyle="none", marker=marker, markersize=8, markerfacecolor="none", markeredgecolor="#555555",
                label=f"{preset['label']} ({preset['gpus']:,} GPUs, MTBF {preset['mtbf_h']:.3g} h)")
        for i, strategy in enumerate(doc["strategies"]):
            ettr = preset["ettr"].get(strategy["strategy"])
            if ettr is None:
                continue
            colour = STRATEGY_STYLES.get(strategy["strategy"], (f"C{i}", "o"))[0]
            ax.plot([preset["gpus"]], [ettr], linestyle="none", marker=marker, markersize=8, markerfacecolor="none",
                    markeredgecolor=colour)
            shown.append(ettr)
    # Zoomed to the values (ETTRs near 1 would otherwise be one flat band), 0 included when near.
    low = min(shown, default=0.0)
    ax.set_ylim(max(0.0, math.floor((low - 0.05) * 10) / 10), 1.0 + 0.01)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (Daly's complete model)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return _png(fig)


def projection_html(doc: dict[str, Any]) -> str:
    """`ffctl project --html`: the plot, the inputs, a table per strategy, the notes and formulas."""
    parts = [f"<p>{_e(fleet_title(doc))}</p>",
             _figure(ettr_png(doc), "ETTR against GPU count",
                     "ETTR (Daly's complete model) against GPU count: a line per strategy for the fleet asked, "
                     "filled points at the counts asked; hollow markers: each preset fleet at the size it was "
                     "measured at, under its own failure rate (dotted lines)."),
             "<h2>inputs from the runs</h2>",
             grid_table(["measured"] + [s["strategy"] for s in doc["strategies"]], input_rows(doc))]
    for strategy in doc["strategies"]:
        parts += [f"<h2>{_e(strategy['strategy'])}</h2>", grid_table(PROJECTION_HEADERS, fleet_rows(strategy), left=0)]
    parts.append(_notes(fleet_notes(doc)))
    parts.append("<h2>formulas</h2><ul>" + "".join(f"<li><code>{_e(line)}</code></li>" for line in doc["formulas"])
                 + "</ul>")
    return document("ffctl project", "".join(parts))


def run_list_html(reports: list[dict[str, Any]], runs_dir: str) -> str:
    """The runs of a runs directory, newest first (no plots)."""
    if not reports:
        return document("ffctl runs", f"<p>no runs in {_e(runs_dir)}</p>")
    rows = [run_row(r) for r in reports]
    return document(f"ffctl runs in {runs_dir}", grid_table(list(rows[0]), [list(r.values()) for r in rows], left=3))
