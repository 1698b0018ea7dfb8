"""The live progress view of `ffctl launch`: step, loss, steps/s, the current fault and the
recovery state. On a terminal it redraws in place; elsewhere (CI logs) it prints a line when the
phase changes and every tenth of the run."""
from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


def step_text(state: dict[str, Any]) -> str:
    """`step/total` for the built-in GPT; a script's step alone (`steps` None): --steps is the
    built-in GPT's length, and a script's length is known only to the script."""
    step, steps = state.get("step"), state.get("steps")
    return f"{step}" if steps is None else f"{step}/{steps}"


def _every(state: dict[str, Any]) -> int:
    """How many steps apart the progress lines of a non-terminal are: a tenth of the run, or,
    without a total (a script), a tenth of the step's order of magnitude (1-9, 10-90, 100-900)."""
    steps = state.get("steps")
    if steps is not None:
        return max(1, int(steps) // 10)
    step = max(1, int(state.get("step") or 0))
    return 10 ** (len(str(step)) - 1)


def _table(state: dict[str, Any]) -> Table:
    table = Table(show_header=True, header_style="bold", title=f"ffctl run {state.get('run_id', '')}")
    for col in ("phase", "gen", "step", "loss", "steps/s", "fault", "strategy"):
        table.add_column(col)
    loss = state.get("loss")
    sps = state.get("steps_per_s")
    table.add_row(
        str(state.get("phase")), str(state.get("gen")), step_text(state),
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
        step, phase = state.get("step") or 0, state.get("phase")
        every = _every(state)
        if phase != self._last_phase or (step // every != self._last_step // every and step != self._last_step):
            loss = state.get("loss")
            self.console.print(
                f"[{phase}] gen {state.get('gen')} step {step_text(state)}"
                + ("" if loss is None else f" loss {loss:.4f}")
                + (f" fault {state['fault']}" if state.get("fault") else ""),
                markup=False, highlight=False,
            )
            self._last_phase, self._last_step = phase, step
