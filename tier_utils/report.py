"""The folder report: CSV tables, PNG plots, JSON and an index.html showing them together.

`write_report` is generic over result objects (it asks only what every Result has) and imports nothing above
core/: what a caller adds (the main job's consistency rows) is handed in as a table. The main job
(`mainjob.run_all`) writes one, and a notebook may write one of its own results.
"""
from __future__ import annotations

import html
import math
import re
from pathlib import Path

import pandas as pd

from .core.display import STATUS_STYLE, readable
from .core.files import atomic_write_bytes, write_json
from .core.plotting import save_png
from .core.results import STATUSES, run_metadata, verdict_line

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")

# A dashboard: the page never scrolls sideways; a long table scrolls inside its own box. Words wrap only
# between words (no `anywhere`/`break-all`, which split "float32" into "float3 2" in a squeezed column;
# `.w` keeps "7.334e-08" whole); a long token (a path, an op name) gets break points after its separators
# instead (`_breakable`).
_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#222}
.scroll{overflow:auto;max-width:100%;max-height:30em;margin:.5em 0}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top;overflow-wrap:break-word}
th{background:#f3f3f3;position:sticky;top:0}
img{max-width:100%;height:auto;border:1px solid #eee}.meta{color:#666;font-size:13px;overflow-wrap:break-word}
.w{white-space:nowrap}.verdict{font-size:17px;font-weight:bold}""" + "".join(
    f".{status}{{{css}}}" for status, css in STATUS_STYLE.items())  # the notebooks' colours
_LONG = 20  # characters: a token this long may break after its separators
_AFTER_SEPARATORS = re.compile(r"(?<=[_./,:=-])")
_PLAIN = re.compile(r"[(\[]*[\w']*[)\]:;,.!?%]*")  # no line-break opportunity inside


def write_report(results: dict, out_dir, title: str = "tier_utils report", metadata: dict | None = None,
                 leading: dict[str, pd.DataFrame] | None = None) -> Path:
    """Write each result's table as `<name>.csv` (a benchmark's verdicts also as `<name>_verdicts.csv`), its
    plot as `<name>.png` (and its `more_plots()` as `<name>_<part>.png`: an image model's predictions), its JSON
    as `<name>.json`, and an `index.html` showing them together (plain HTML, relative links). The page shows each
    tier's verdict columns (check, status, value, threshold, detail, after the columns naming the row), a
    benchmark's verdicts rather than its measurements; the CSV links hold every column. Returns index.html.

    metadata: the run's device/torch/time stamp shown under the title (default: `run_metadata()`).
    leading: tables by name shown before the results, each with its CSV; an empty one is left out (the main job's
    consistency rows, which say how far to trust the tiers' timings)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections, nav = [], []
    for name, result in results.items():
        if not _NAME.match(name):
            raise ValueError(f"result name {name!r} is not a plain file name; use letters, digits, _ or -")
        frames = {f"{name}{suffix}": frame for suffix, frame in result.tables().items()}
        for stem, frame in frames.items():
            atomic_write_bytes(out / f"{stem}.csv", frame.to_csv(index=False).encode())
        write_json(out / f"{name}.json", result.to_json())
        figures = {name: result.plot(), **{f"{name}_{part}": fig for part, fig in result.more_plots().items()}}
        pngs = [f"{stem}.png" for stem, fig in figures.items() if fig is not None]
        for stem, fig in figures.items():
            if fig is not None:
                save_png(fig, out / f"{stem}.png")
        verdict = result.verdict
        badge = f" <span class='{verdict}'>{verdict}</span>" if verdict else ""
        nav.append(f"<a href='#{name}'>{html.escape(name)}</a>{badge}")
        shown = result.verdict_table()
        files = [f"{stem}.csv" for stem in frames] + [f"{name}.json"]
        sections.append(_section(name, badge, result.summary_line(), shown, files, pngs))
        for part, frame in result.more_tables().items():  # e.g. what an encoder-decoder wrote
            stem = f"{name}_{part}"
            atomic_write_bytes(out / f"{stem}.csv", frame.to_csv(index=False).encode())
            sections.append(_section(stem, "", "", frame, [f"{stem}.csv"], []))
    for name, frame in reversed([(n, f) for n, f in (leading or {}).items() if len(f)]):
        atomic_write_bytes(out / f"{name}.csv", frame.to_csv(index=False).encode())
        sections.insert(0, _section(name, "", "", frame, [f"{name}.csv"], []))
    meta = metadata if metadata is not None else run_metadata()
    meta_line = " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items())
    page = (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head>\n<body><h1>{html.escape(title)}</h1>\n"
            f"<p class='verdict'>{html.escape(verdict_line(results))}</p>\n"
            f"<p class='meta'>{meta_line}</p>\n<p>{' · '.join(nav)}</p>\n" + "\n".join(sections)
            + "\n</body></html>\n")
    return atomic_write_bytes(out / "index.html", page.encode())


def _section(name: str, badge: str, summary: str, table: pd.DataFrame, files: list[str], pngs: list[str]) -> str:
    shown = _for_page(table)
    hidden = len(table.columns) - len(shown.columns)
    note = f" (the page leaves out {hidden} column{'s' if hidden != 1 else ''}; the CSV has all)" if hidden else ""
    links = " · ".join(f"<a href='{f}'>{f}</a>" for f in files)
    rows = shown.to_html(index=False, border=0, escape=False)
    for s in STATUSES:  # colour the verdict cells
        rows = rows.replace(f"<td>{s}</td>", f"<td class='{s}'>{s}</td>")
    parts = [f"<section id='{name}'><h2>{html.escape(name)}{badge}</h2>",
             *([f"<p class='summary'>{html.escape(summary)}</p>"] if summary else []), f"<p>{links}{note}</p>",
             f"<div class='scroll'>{rows}</div>"]
    parts += [f"<p><img src='{png}' alt='{html.escape(png.removesuffix('.png'))} plot'></p>" for png in pngs]
    parts.append("</section>")
    return "\n".join(parts)


def _for_page(table: pd.DataFrame) -> pd.DataFrame:
    """The table as the page shows it, as a notebook does (core/display.readable): a verdict table's columns naming
    the row (left of `check`) and its verdict columns, no column that is empty throughout, at most MAX_COLUMNS
    (12: the CSV beside it has every one), every cell as escaped HTML. The statuses are the table's
    own: the page, `.table` and the CLI read alike."""
    shown = readable(table)[0]
    return shown.astype(object).where(shown.notna(), None).map(_cell)


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return " ".join(_breakable(word) for word in text.split(" "))


def _breakable(word: str) -> str:
    """`word` as HTML: a long token (a path, an op name) may wrap after its separators; a word never
    breaks inside."""
    parts = _AFTER_SEPARATORS.split(word) if len(word) >= _LONG else [word]
    # A browser may also wrap inside at a hyphen or slash ("7.334e-" / "08"): such a part can't wrap.
    return "<wbr>".join(html.escape(p) if _PLAIN.fullmatch(p) else f"<span class='w'>{html.escape(p)}</span>"
                        for p in parts)
