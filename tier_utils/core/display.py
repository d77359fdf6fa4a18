"""Tables as a person reads them, in a notebook and on the report page: the verdict columns, at most
`MAX_COLUMNS` of them, figures rounded to what their spread supports, empty cells blank, statuses coloured.
The full frame stays where it was (`.table`, the CSV, the JSON); this module only decides how it is shown."""
from __future__ import annotations

import html
import math

import pandas as pd

from .status import CHECK_COLUMNS, STATUSES

MAX_COLUMNS = 12  # wider than a notebook cell at ~1280 px: the rest stays in `.table`
# The statuses' colours, declared once: the report page's CSS and the notebook tables both read them.
STATUS_STYLE = {"PASS": "color:#176f2c", "WARN": "color:#9a6700", "FAIL": "color:#b42318;font-weight:bold",
                "SKIP": "color:#666"}
_SPREADS = (("median", "iqr"),)  # a column with "median" in its name, and its spread's column


def verdict_columns(table: pd.DataFrame) -> list[str]:
    """A verdict table's columns naming the row (left of `check`) and its verdict columns; any other table's
    columns as they are."""
    columns = list(table.columns)
    if {"check", "status"} <= set(columns):
        columns = columns[:columns.index("check")] + [c for c in CHECK_COLUMNS if c in columns]
    return columns


def is_empty(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA


def round_to_spread(frame: pd.DataFrame) -> pd.DataFrame:
    """Each median, its IQR and the figures in the same unit (min_ms, p95_ms beside median_ms) rounded to the
    IQR's second significant digit (a 0.105047 ± 0.0043 ms median reads 0.105): more digits would be noise.
    Rows without a spread keep their figures."""
    out = frame.copy()
    for middle, spread in _SPREADS:
        for column in [c for c in frame.columns if middle in str(c)]:
            twin = str(column).replace(middle, spread)
            if twin not in frame.columns:
                continue
            digits = [_decimals(s) for s in frame[twin]]
            unit = str(column).split(middle, 1)[1]  # "_ms"
            for same in [c for c in frame.columns if unit and str(c).endswith(unit)] or [column, twin]:
                out[same] = [v if d is None or not isinstance(v, float) or is_empty(v) else round(v, d)
                             for v, d in zip(frame[same], digits)]
    return out


def _decimals(spread) -> int | None:
    if is_empty(spread) or not isinstance(spread, (int, float)) or spread <= 0 or not math.isfinite(spread):
        return None
    return max(0, 1 - math.floor(math.log10(spread)))


def readable(table: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """The table to show: its verdict columns, no column empty throughout, at most MAX_COLUMNS with a named index's
    columns (shown too) counted among them; and how many columns were left out."""
    shown = round_to_spread(table[verdict_columns(table)])
    shown = shown.loc[:, [c for c in shown.columns if not shown[c].map(is_empty).all()]]
    room = MAX_COLUMNS - len([n for n in table.index.names if n is not None])
    hidden = len(table.columns) - min(len(shown.columns), room)
    return shown.iloc[:, :room], hidden


def cell_text(value) -> str:
    """A cell as text: blank when empty, a float to 4 significant digits (what a rounded figure already is)."""
    if is_empty(value):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 or value != int(value) else f"{value:,.0f}"
    return str(value)


def html_table(table: pd.DataFrame, caption: str | None = None) -> str:
    """`table` as a notebook's HTML: `readable()`'s columns, statuses coloured as on the report page, a named
    index shown (a meaningful one, such as precision and checkpointing), a note when columns were left out."""
    shown, hidden = readable(table)
    index = [n for n in shown.index.names if n is not None]
    head = "".join(f"<th>{html.escape(str(n))}</th>" for n in [*index, *shown.columns])
    rows = []
    for key, row in shown.iterrows():
        keys = (key if isinstance(key, tuple) else (key,)) if index else ()
        cells = [f"<th>{html.escape(cell_text(k))}</th>" for k in keys]
        for value in row:
            text = cell_text(value)
            style = f" style='{STATUS_STYLE[text]}'" if text in STATUSES else ""
            cells.append(f"<td{style}>{html.escape(text)}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    parts = [f"<p>{html.escape(caption)}</p>"] if caption else []
    parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>")
    if hidden:
        parts.append(f"<p><small>{hidden} more column{'s' * (hidden != 1)} in <code>.table</code> "
                     "(and the CSV)</small></p>")
    return "\n".join(parts)
