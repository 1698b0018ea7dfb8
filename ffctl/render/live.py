"""The live progress view of `ffctl launch`: step, loss, steps/s, the current fault and the
recovery state. On a terminal it redraws in place; elsewhere (CI logs) it prints a line when the
phase changes and every tenth of the run."""
from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _table(state: dict[str, Any]) -> Table:
    table = Table(show_header=True, header_style="bold", title=f"ffctl run {state.get('run_id', '')}")
    for col in ("phase", "gen", "step", "loss", "steps/s", "fault", "strategy"):
        table.add_column(col)
    loss = state.get("loss")
    sps = state.get("steps_per_s")
    table.add_row(
        str(state.get("phase")), str(state.get("gen")), f"{state.get('step')}/{state.get('steps')}",
        "-" if loss is None else f"{loss:.4f}", "-" if sps is None else f"{sps:.1f}",
        state.get("fault") or "-", str(state.get("strategy")),
    )
    return table


class LiveView:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.live: Live | None = Live(console=console, refresh_per_second=8, transient=False) if console.is_terminal else None
        self._last_phase: str | None = None
        self._notices = 0  # how many of the run's notices were printed
        self._last_step = -1

    def __enter__(self) -> LiveView:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if self.live is not None:
            self.live.__exit__(et, ev, tb)

    def __call__(self, state: dict[str, Any]) -> None:
        # Every notice once, in order, repeats included: a rank failing twice in the same way
        # is two lines (a failed rank, a fallback to disk, why the job stops).
        notices = state.get("notices") or ()
        for notice in list(notices)[self._notices:]:
            self.console.print(f"ffctl: {notice}", markup=False, highlight=False, style="bold yellow",
                               soft_wrap=True)
        self._notices = max(self._notices, len(notices))
        if self.live is not None:
            self.live.update(_table(state))
            return
        step, steps, phase = state.get("step", 0), state.get("steps", 1) or 1, state.get("phase")
        every = max(1, steps // 10)
        if phase != self._last_phase or (step // every != self._last_step // every and step != self._last_step):
            loss = state.get("loss")
            self.console.print(
                f"[{phase}] gen {state.get('gen')} step {step}/{steps}"
                + ("" if loss is None else f" loss {loss:.4f}")
                + (f" fault {state['fault']}" if state.get("fault") else ""),
                markup=False, highlight=False,
            )
            self._last_phase, self._last_step = phase, step
