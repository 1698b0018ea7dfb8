"""Tables that never cut a value: a table where it fits the console's width, and otherwise the
same rows as `field: value` records. Rich shrinks a table that is too wide by cutting its cells
with "…" (an 80-column terminal cut `ffctl doctor`'s 15 columns to one letter each); a reader
of a narrow terminal or a CI log needs every value whole."""
from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text


def key_values(title: str | None, fields: list[tuple[str, str]]) -> Table:
    """Two columns, `field  value`, without borders."""
    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0), title=title, title_justify="left",
                  title_style="bold")
    table.add_column(style="bold", no_wrap=True)
    # Only a value wider than the whole line is folded: nothing is ever cut.
    table.add_column(overflow="fold")
    for key, value in fields:
        table.add_row(key, value)
    return table


def grid(title: str | None, headers: list[str], rows: list[list[str]], left: int = 1,
         tight: bool = False) -> Table:
    """A table with a header line; the first `left` columns flush left, the rest right."""
    # Two spaces between columns; `tight`: one, before giving up on a table.
    table = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, padding=(0, 0) if tight else (0, 1), collapse_padding=True)
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < left else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def fits(console: Console, table: Table) -> bool:
    """Whether `table` is drawn on the console without shrinking a column."""
    # Measured against a very wide line: measuring against the console's own width clamps the
    # answer to it, and every table would seem to fit.
    natural = console.measure(table, options=console.options.update_width(1 << 16))
    return natural.maximum <= console.width


def table_or_records(console: Console, title: str, headers: list[str], rows: list[list[str]],
                     left: int = 1, *, one_line: bool = False) -> None:
    """`rows` under `headers` as a table where it fits, else as records: a block of `field value`
    lines per row, or with `one_line` a line per row (`first  field: value  ...`, wrapped, for
    lists of many rows such as the runs)."""
    for tight in (False, True):
        table = grid(title, headers, rows, left, tight)
        if fits(console, table):
            console.print(table)
            return
    console.print(title, style="bold", markup=False, highlight=False)
    for row in rows:
        if one_line:
            for line in _flow([row[0]] + [f"{h}: {v}" for h, v in zip(headers[1:], row[1:])], console):
                console.print(line, highlight=False, soft_wrap=True)
            continue
        console.print(key_values(None, list(zip(headers, row))))
        console.print()




def _flow(fields: list[str], console: Console) -> list[str]:
    """`fields` two spaces apart, broken into lines between fields (never inside one) to fit the
    console; continuation lines indented."""
    lines, line = [], ""
    for field in fields:
        joined = f"{line}  {field}" if line else field
        if line and Text.from_markup(joined).cell_len > console.width:
            lines.append(line)
            joined = "  " + field
        line = joined
    return lines + [line]
