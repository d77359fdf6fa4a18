"""Small helpers every tier's figure shares, so all plots read the same way: whole-number step axes,
layer names short enough to read, and a one-line caption where the picture needs one."""
from __future__ import annotations

import io
import math
from pathlib import Path

from .files import atomic_write_bytes

MIN_FONT_PT = 7  # tick labels below this are unreadable in a 100-dpi PNG
MAX_TICKS = 30  # labelled categories per axis; more are thinned


def integer_axis(axis) -> None:
    """Ticks on whole numbers only (steps, trials): no 12.5 or 0.5."""
    from matplotlib.ticker import MaxNLocator

    axis.set_major_locator(MaxNLocator(integer=True))


def short_name(name: str, width: int = 22) -> str:
    """A module path cut to its last components, so `blocks.0.attn.out_proj` stays recognisable."""
    if len(name) <= width:
        return name
    parts, kept = name.split("."), ""
    for part in reversed(parts):
        candidate = f"{part}.{kept}" if kept else part
        if len(candidate) + 1 > width:
            break
        kept = candidate
    return "…" + (kept or name[-(width - 1):])


def category_ticks(ax, names, axis: str = "x", rotation: int = 45) -> None:
    """Label categories 0..n-1 with their short names, thinned to at most MAX_TICKS, readable size."""
    step = max(1, -(-len(names) // MAX_TICKS))
    positions = list(range(0, len(names), step))
    labels = [short_name(str(names[i])) for i in positions]
    if axis == "x":
        ax.set_xticks(positions, labels, rotation=rotation, ha="right" if rotation else "center",
                      rotation_mode="anchor", fontsize=8)
    else:
        ax.set_yticks(positions, labels, fontsize=8)


def caption(fig, text: str) -> None:
    """One line under the figure that says how to read it (constrained layout keeps room for it)."""
    fig.supxlabel(text, fontsize=9, color="#444")


def power_of_two_axis(ax, values) -> None:
    """A log2 y axis whose limits are the powers of two around `values` (a loss scale): the lowest
    and highest values sit on labelled ticks, never outside them."""
    lo, hi = float(min(values)), float(max(values))
    lo_exp, hi_exp = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    hi_exp = max(hi_exp, lo_exp + 1)
    ax.set_yscale("log", base=2)
    ax.set_ylim(2.0 ** lo_exp / 1.2, 2.0 ** hi_exp * 1.2)
    ax.set_yticks([2.0 ** e for e in range(lo_exp, hi_exp + 1, max(1, (hi_exp - lo_exp) // 6))])


def decade_limits(ax) -> None:
    """A log y axis widened to whole decades around its data, so at least two ticks carry labels."""
    lo_exp, hi_exp = (math.log10(v) for v in ax.get_ylim())
    ax.set_ylim(10.0 ** math.floor(lo_exp), 10.0 ** max(math.ceil(hi_exp), math.floor(lo_exp) + 1))


def save_png(fig, path) -> Path:
    """`fig` as a 100-dpi PNG, written atomically; then freed if pyplot tracks it (nobody displays it)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    written = atomic_write_bytes(path, buf.getvalue())
    import matplotlib.pyplot as plt
    plt.close(fig)
    return written


def readable_legends(fig, size: float = 9) -> None:
    """Every legend of `fig` at `size` points: a grid of small panels drawn for their own figures uses 7-point
    legends, unreadable once a notebook scales the grid to its width."""
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            for text in [*legend.get_texts(), legend.get_title()]:
                text.set_fontsize(size)
